"""s3:// checkpoints across processes: the local stack's object store when no endpoint is configured, and an uploader
killed halfway that leaves no checkpoint behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from agentstream.infra.checkpoint_store import (
    MANIFEST,
    CheckpointNotFound,
    CheckpointReader,
    S3Store,
    open_store,
    sha256_file,
)
from agentstream.infra.config import CHECKPOINT_BUCKET, CheckpointsConfig, Config
from agentstream.stack.control import Endpoints
from agentstream.trainer.checkpoint_writer import latest_manifest, write_checkpoint
from tests.support.s3_checkpoints import KEY_ID, LOCATION, SECRET, EmbeddedStore, s3_store, write


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


ROOT = Path(__file__).resolve().parents[2]

CRASHING_UPLOADER = """
import sys, time
from pathlib import Path
from agentstream.infra.config import CheckpointsConfig, Secret
from agentstream.infra.checkpoint_store import MANIFEST, open_store
from agentstream.trainer.checkpoint_writer import write_checkpoint

endpoint, home, marker = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
settings = CheckpointsConfig(s3_endpoint=endpoint, s3_access_key_id=sys.argv[4],
                             s3_secret_access_key=Secret(sys.argv[5]), cache_dir=str(home / "uploader-cache"))
store = open_store(sys.argv[6], settings, home)
put_object = store._client.put_object

def stop_before_the_manifest(**request):
    if request["Key"].endswith(MANIFEST):
        marker.write_text("weights stored")
        time.sleep(600)  # the test kills this process here
    return put_object(**request)

store._client.put_object = stop_before_the_manifest
staging = store.staging()
(staging / "model.safetensors").write_bytes(b"weights" * 1000)
write_checkpoint(store, staging, staging / "model.safetensors", model="m", version=1, step=1, format="full",
                 offsets={}, trained_ids=[], metrics={})
marker.write_text("put returned: announced")  # the trainer announces only after put() returns
"""


def test_an_uploader_killed_before_the_manifest_leaves_no_checkpoint(tmp_path: Path):
    embedded = EmbeddedStore(tmp_path / "objects")
    try:
        uploader_killed_before_the_manifest(embedded, tmp_path)
    finally:
        embedded.stop()


def uploader_killed_before_the_manifest(embedded: EmbeddedStore, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", CRASHING_UPLOADER, embedded.url, str(tmp_path), str(marker),
                              KEY_ID, SECRET, LOCATION], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.read_text() == "weights stored", "the uploader did not reach the manifest"
        assert embedded.object_path("checkpoints/m/v00000001/model.safetensors").is_file()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    assert not embedded.object_path(f"checkpoints/m/v00000001/{MANIFEST}").exists()
    store = s3_store(embedded, tmp_path)
    assert store.names("m") == [] and latest_manifest(store, "m") is None
    with pytest.raises(CheckpointNotFound, match="does not exist"):
        store.get(f"{LOCATION}/m/v00000001")
    assert marker.read_text() == "weights stored"  # never announced
    assert store.cache.entries() == []
    uri = write(store, 1, b"written again")  # the restarted trainer writes the version afresh
    assert store.names("m") == ["m/v00000001"]
    assert (store.get(uri) / "model.safetensors").read_bytes() == b"written again"
