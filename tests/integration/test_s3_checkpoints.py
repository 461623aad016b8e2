"""The local stack serves s3:// checkpoints from its embedded object store when no endpoint is configured."""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path

from infra.checkpoint_store import CheckpointReader, S3Store, open_store, sha256_file
from infra.config import CHECKPOINT_BUCKET, CheckpointsConfig, Config
from stack.control import Endpoints
from trainer.checkpoints import latest_manifest, write_checkpoint


def test_an_s3_store_without_an_endpoint_uses_the_stacks_object_store(stack_config: Config, stack: Endpoints,
                                                                       tmp_path: Path):
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    config = replace(stack_config, checkpoints=CheckpointsConfig(cache_dir=str(tmp_path / "trainer-cache")))
    store = open_store(f"s3://{CHECKPOINT_BUCKET}/{prefix}", config.checkpoints, config.stack.home)  # as the trainer
    assert isinstance(store, S3Store) and (store.endpoint or "").startswith("http://127.0.0.1:")
    staging = store.staging()
    (staging / "model.safetensors").write_bytes(b"weights" * 1000)
    manifest = write_checkpoint(store, staging, staging / "model.safetensors", model="m", version=1, step=1,
                                format="full", offsets={}, trained_ids=[], metrics={})
    assert latest_manifest(store, "m").version == 1
    stored = config.stack.home / "broker-data" / CHECKPOINT_BUCKET / prefix / "m" / "v00000001" / "model.safetensors"
    assert stored.read_bytes() == b"weights" * 1000
    reader = CheckpointReader(replace(config.checkpoints, cache_dir=str(tmp_path / "server-cache")), config.stack.home)
    folder = reader.local_folder(manifest.uri)  # as hot swap, on the server's machine
    assert folder.parent == tmp_path / "server-cache"
    assert sha256_file(folder / "model.safetensors") == manifest.sha256
