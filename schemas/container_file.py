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

from .binary import END, write_long
from .errors import AgentstreamError

MAGIC = b"Obj\x01"


def _bytes(value: bytes) -> bytes:
    return write_long(len(value)) + value


def container_file(schema: dict[str, Any], bodies: Sequence[bytes | memoryview]) -> bytes:
    """One object container file holding ``bodies`` (Avro binary datums written with ``schema``)."""
    sync = os.urandom(16)
    metadata = {b"avro.schema": json.dumps(schema, separators=(",", ":")).encode(), b"avro.codec": b"null"}
    header = MAGIC + write_long(len(metadata)) + b"".join(_bytes(k) + _bytes(v) for k, v in metadata.items())
    size = sum(len(body) for body in bodies)
    return b"".join([header, END, sync, write_long(len(bodies)), write_long(size), *bodies, sync])  # one copy


class ContainerError(AgentstreamError, ValueError):
    """Bytes that are not an uncompressed Avro object container file."""


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if position >= len(data):
            raise ContainerError("truncated varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), position
        shift += 7


def read_container(data: bytes) -> tuple[dict[str, Any], list[tuple[int, bytes]]]:
    """The writer schema of a container file and its blocks: how many datums each holds and their bytes.

    Concatenated datums preceded by their count and followed by a zero are an Avro array, so
    a block becomes the body of a batch record without decoding a single datum.
    """
    if data[:4] != MAGIC:
        raise ContainerError("not an Avro object container file")
    position, metadata = 4, {}
    while True:
        count, position = _read_varint(data, position)
        if count == 0:
            break
        if count < 0:
            _, position = _read_varint(data, position)
            count = -count
        for _ in range(count):
            key_length, position = _read_varint(data, position)
            key = data[position:position + key_length]
            position += key_length
            value_length, position = _read_varint(data, position)
            metadata[key] = data[position:position + value_length]
            position += value_length
    codec = metadata.get(b"avro.codec", b"null")
    if codec != b"null":
        raise ContainerError(f"container file is compressed with {codec.decode()}; ask for codec null")
    position += 16
    blocks = []
    while position < len(data):
        count, position = _read_varint(data, position)
        size, position = _read_varint(data, position)
        blocks.append((count, data[position:position + size]))
        position += size + 16
    return json.loads(metadata[b"avro.schema"]), blocks
