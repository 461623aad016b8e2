"""Avro object container files built from raw Avro bodies, so ClickHouse decodes spans instead of Python.

A container file is a header (magic, the writer schema as JSON, a sync marker) followed by
blocks of concatenated datums. The bodies of Confluent wire-format records are exactly such
datums, so a batch of Kafka records becomes a file by concatenation: no per-span work here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

MAGIC = b"Obj\x01"


def _varint(value: int) -> bytes:
    """Avro's zig-zag variable-length encoding of a long."""
    value = (value << 1) ^ (value >> 63)
    out = bytearray()
    while value & ~0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _bytes(value: bytes) -> bytes:
    return _varint(len(value)) + value


def container_file(schema: dict[str, Any], bodies: Sequence[bytes | memoryview]) -> bytes:
    """One object container file holding ``bodies`` (Avro binary datums written with ``schema``)."""
    sync = os.urandom(16)
    metadata = {b"avro.schema": json.dumps(schema, separators=(",", ":")).encode(), b"avro.codec": b"null"}
    header = MAGIC + _varint(len(metadata)) + b"".join(_bytes(k) + _bytes(v) for k, v in metadata.items())
    header += _varint(0) + sync
    payload = b"".join(bodies)
    return header + _varint(len(bodies)) + _varint(len(payload)) + payload + sync
