"""The proxy's reading of W3C trace context: traceparent and baggage headers."""

from __future__ import annotations

from agentstream.pipeline.proxy.server import trace_context


def test_traceparent_and_baggage_parsing():
    from multidict import CIMultiDict

    headers = CIMultiDict(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    headers.add("baggage", "agentstream.agent_name=math%20agent;p=1, other=x")
    headers.add("baggage", "agentstream.train=false")
    context = trace_context(headers)
    assert (context.trace_id, context.parent_span_id) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    assert context.baggage == {"agentstream.agent_name": "math agent", "other": "x", "agentstream.train": "false"}
    for bad in ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", "ff-4bf92f3577b34da6a3ce929d0e0e4736-"
                "00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", "junk"):
        assert trace_context(CIMultiDict(traceparent=bad)).trace_id is None, bad
