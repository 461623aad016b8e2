"""The Checkpoint record: one definition for the checkpoints topic's event and the checkpoints table's row."""

from __future__ import annotations

import dataclasses
import datetime
from types import SimpleNamespace

from agentstream.deploy.checkpoint_follower import checkpoint_of
from agentstream.schemas import CHECKPOINT, AvroCodec, current_schemas
from agentstream.schemas.checkpoint import CHECKPOINT_COLUMNS, Checkpoint
from agentstream.trainer.checkpoint_writer import Manifest

CODEC = AvroCodec()
CHECKPOINT_RECORD = Checkpoint(model="m", version=3, uri="file:///ckpt/m/v00000003", sha256="ab" * 32, step=7,
                               created_at_us=1_764_000_000_123_456, metrics={"loss": 0.5}, format="lora")


def test_the_record_has_the_events_fields_and_survives_the_wire():
    fields = [field["name"] for field in current_schemas()[CHECKPOINT]["fields"]]
    assert [field.name for field in dataclasses.fields(Checkpoint)] == fields
    decoded = CODEC.decode(CODEC.encode(CHECKPOINT, CHECKPOINT_RECORD.record()), CHECKPOINT)[1]
    assert Checkpoint.from_record(decoded) == CHECKPOINT_RECORD


def test_the_row_reads_back_to_the_same_record_to_the_microsecond():
    row = CHECKPOINT_RECORD.row()
    assert len(row) == len(CHECKPOINT_COLUMNS) and row[CHECKPOINT_COLUMNS.index("created_at")].tzinfo is datetime.UTC
    assert Checkpoint.from_row(row) == CHECKPOINT_RECORD
    naive = (*row[:-1], row[-1].replace(tzinfo=None))  # a client that drops the column's zone
    assert Checkpoint.from_row(naive) == CHECKPOINT_RECORD


def test_the_trainers_manifest_announces_the_record():
    manifest = Manifest(model="m", version=3, step=7, format="lora", weights_file="adapter_model.safetensors",
                        sha256="ab" * 32, uri="file:///ckpt/m/v00000003", created_at_us=1_764_000_000_123_456,
                        offsets={"t:0": 5}, trained_ids=["a"], metrics={"loss": 0.5})
    assert manifest.checkpoint() == CHECKPOINT_RECORD


def test_a_reader_gets_the_record_of_its_own_model_only():
    def record(key: bytes, value: bytes | None) -> SimpleNamespace:
        return SimpleNamespace(key=key, value=value, offset=0)

    value = CODEC.encode(CHECKPOINT, CHECKPOINT_RECORD.record())
    assert checkpoint_of(record(b"m", value), "m", CODEC) == CHECKPOINT_RECORD
    assert checkpoint_of(record(b"other", value), "m", CODEC) is None
    assert checkpoint_of(record(b"m", None), "m", CODEC) is None  # a tombstone
    assert checkpoint_of(record(b"m", b"\x00\x00"), "m", CODEC) is None  # skipped with its reason logged
