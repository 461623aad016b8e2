"""Read a Weights & Biases offline run back: its ``.wandb`` file, decoded with wandb's own protobuf ``Record``.

wandb 0.31 has no public reader of offline runs (``wandb sync`` hands the file to its Go core),
so this reads the framing the file is written in: a 7-byte header (``:W&B``, magic 0xBEE1,
version 0), then 32 KiB blocks of chunks, each with a 4-byte checksum, a 2-byte little-endian
length and a type (1 whole, 2 first, 3 middle, 4 last), LevelDB's log format. Each record is
a ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7
WHOLE, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of a ``.wandb`` file, in order."""
    data = path.read_bytes()
    assert data.startswith(HEADER), f"{path} is not a .wandb file"
    found, pending, offset = [], b"", len(HEADER)
    while offset + CHUNK_HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            offset += room
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        if kind == 0 and length == 0:
            break
        payload = data[offset + CHUNK_HEADER:offset + CHUNK_HEADER + length]
        offset += CHUNK_HEADER + length
        pending = payload if kind in (WHOLE, FIRST) else pending + payload
        if kind in (WHOLE, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


@dataclass
class OfflineRun:
    """What an offline run directory holds: the run's name and config, its history rows and its saved files."""

    folder: Path
    name: str = ""
    config: dict[str, object] = field(default_factory=dict)
    history: list[dict[str, object]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def read_offline_run(folder: Path) -> OfflineRun:
    """Read ``offline-run-*`` ``folder``: the run record, the config updates, every history row, the saved files."""
    (path,) = folder.glob("run-*.wandb")
    run = OfflineRun(folder)
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name = record.run.display_name
            run.config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run.config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            run.history.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                                for item in record.history.item})
        elif kind == "files":
            run.files += [file.path for file in record.files.files]
    return run
