"""agentstream's compiled hot paths: span batches read straight from their Avro bytes, OTLP arrays read in bulk."""

from collections.abc import Callable, Sequence
from typing import Any

__version__: str

class SpanReader:
    """Reads the datums of one writer schema; span records become ``node(**keywords)``."""

    def __init__(self, schema_json: str, node: Callable[..., Any], malformed: type[Exception], skipped: list[str],
                 train_key: bytes, train_words: list[tuple[bytes, bool]]) -> None: ...
    def datum(self, body: bytes, what: str) -> tuple[Any, int]:
        """One datum at the start of ``body``: its value and the position after it."""
    def rows(self, count: int, datums: bytes, what: str) -> list[Any]:
        """``count`` datums back to back (a block of an Avro container file)."""

def array_values(serialized: bytes) -> list[Any] | None:
    """The values of a serialized OTLP ``ArrayValue`` when all are strings, bools, ints or doubles of one kind."""

def span_records(batches: Sequence[Sequence[tuple[bytes, bytes, bytes, bytes, bytes, int]]], headers: Sequence[bytes],
                 trailer: bytes) -> list[bytes]:
    """Each batch's record: its header, its prepared spans with their int32 token ids as sized varint blocks, then
    ``trailer``."""
