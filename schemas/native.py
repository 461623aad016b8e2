"""The compiled extension (``native/``, Rust, built by ``make install``), imported in one place, with the error that
says how to build it where it is missing."""

try:
    from agentstream_native import SpanReader as CompiledSpanReader
    from agentstream_native import array_values, span_records
except ModuleNotFoundError as missing:  # an install that skipped `make install`'s build of native/
    raise ImportError("agentstream's compiled code (agentstream_native) is not installed: run `make install`, "
                      "or `pip install ./native` from the checkout (it needs Rust's cargo)") from missing

__all__ = ["CompiledSpanReader", "array_values", "span_records"]
