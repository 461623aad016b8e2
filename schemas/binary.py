"""Avro's binary encoding: the pieces the span writer, the span reader and the transition writer share.

One definition of each: the union branch bytes of a ``["null", X]`` field, the zero count that
ends an array or map, zigzag varints, strings, the float structs, the token arrays a Span and a
Transition both hold, and the check that a hand-written layout still matches its bundled schema.
"""

from __future__ import annotations

import struct

from .catalog import current_schemas
from .errors import EncodeError
from .schema_ids import schema_id

NULL = b"\x00"
"""Union branch 0: the null of every ``["null", X]`` field of Span and Transition."""
PRESENT = b"\x02"
"""Union branch 1 (zigzag 1): the value of every ``["null", X]`` field of Span and Transition."""
END = b"\x00"
"""The zero block count that ends an array or a map; an empty one is only this."""
DOUBLE = struct.Struct("<d")
FLOAT = struct.Struct("<f")

TOKEN_FIELDS = ("prompt_token_ids", "response_token_ids", "response_logprobs")
"""A Span's token arrays, in its field order; a Transition holds the same three arrays in the same order.

The span reader keeps them encoded (without the Span's union branch) and the transition writer
copies them into a Transition as they are (the logprobs as ``behaviour_logprobs``): they are
never decoded in between.
"""

# Zigzag varints of -64..63, the longs that fit one byte (lengths, counts, union branches).
_SMALL_LONGS = tuple(bytes([(n << 1) ^ (n >> 63)]) for n in range(-64, 64))
_HIGH_VARINTS: dict[int, bytes] = {}  # bits above the lowest 21 of a zigzag value -> their varint
_HIGH_VARINTS_MAX = 1 << 14  # a full cache is emptied and refilled


def write_long(value: int) -> bytes:
    """The zigzag varint of a 64-bit signed integer, as Avro writes `int` and `long`."""
    if -64 <= value < 64:
        return _SMALL_LONGS[value + 64]
    zigzag = (value << 1) ^ (value >> 63)
    if zigzag < 1 << 14:
        return bytes((zigzag & 0x7F | 0x80, zigzag >> 7))
    if zigzag < 1 << 21:
        return bytes((zigzag & 0x7F | 0x80, zigzag >> 7 & 0x7F | 0x80, zigzag >> 14))
    # Timestamps share their bits above the lowest 21 for about a second: cache the varint of those.
    high = zigzag >> 21
    rest = _HIGH_VARINTS.get(high)
    if rest is None:
        if len(_HIGH_VARINTS) >= _HIGH_VARINTS_MAX:
            _HIGH_VARINTS.clear()
        rest = _HIGH_VARINTS[high] = _unsigned_varint(high)
    return bytes((zigzag & 0x7F | 0x80, zigzag >> 7 & 0x7F | 0x80, zigzag >> 14 & 0x7F | 0x80)) + rest


def _unsigned_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def write_string(value: str) -> bytes:
    """An Avro string: the byte length as a long, then the UTF-8 bytes (raises UnicodeEncodeError for a lone
    surrogate)."""
    encoded = value.encode()
    size = len(encoded)
    return (_SMALL_LONGS[size + 64] if size < 64 else write_long(size)) + encoded


def check_layout(record: str, expected_id: int, writer: str) -> None:
    """Raise EncodeError unless the bundled schema of ``record`` has ``expected_id``, the layout ``writer`` writes by
    hand: a different schema has a different content address, and a writer refuses to run rather than write wrong
    bytes."""
    actual = schema_id(current_schemas()[record])
    if actual != expected_id:
        name = record.rpartition(".")[2]
        raise EncodeError(f"{writer} writes the {name} schema with id {expected_id}, but the bundled {name} "
                          f"schema has id {actual}: update {writer} to the new layout")
