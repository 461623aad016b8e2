"""The embedded object store on a free loopback port, checking SigV4 signatures, and s3:// checkpoint stores on it."""

from __future__ import annotations

from pathlib import Path

from agentstream.infra.checkpoint_store import S3Store, open_store
from agentstream.infra.config import CHECKPOINT_BUCKET, CheckpointsConfig, Secret
from agentstream.stack.objectstore import ObjectStoreServer
from agentstream.trainer.checkpoint_writer import write_checkpoint
from tests.support.http_thread import ServerThread

KEY_ID, SECRET = "trainer", "s3cr3t-never-printed"
LOCATION = f"s3://{CHECKPOINT_BUCKET}/checkpoints"


class EmbeddedStore:
    """The stack's object store on a free loopback port, checking signatures against one key pair."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server = ObjectStoreServer(root, [CHECKPOINT_BUCKET], credentials={KEY_ID: SECRET})
        self.thread = ServerThread(self.server.app)
        self.url = self.thread.url

    def object_path(self, key: str) -> Path:
        return self.root / CHECKPOINT_BUCKET / key

    def stop(self) -> None:
        self.thread.stop()
        self.server.close()


def settings(embedded: EmbeddedStore, cache: Path, secret: str = SECRET, key_id: str = KEY_ID,
             **cache_bounds: float) -> CheckpointsConfig:
    return CheckpointsConfig(s3_endpoint=embedded.url, s3_access_key_id=key_id, s3_secret_access_key=Secret(secret),
                             s3_multipart_mb=5, cache_dir=str(cache), **cache_bounds)


def s3_store(embedded: EmbeddedStore, tmp_path: Path, cache: str = "cache", **cache_bounds: float) -> S3Store:
    store = open_store(LOCATION, settings(embedded, tmp_path / cache, **cache_bounds), home=tmp_path)
    assert isinstance(store, S3Store)
    return store


def write(store: S3Store, version: int, weights: bytes, model: str = "m") -> str:
    staging = store.staging()
    (staging / "model.safetensors").write_bytes(weights)
    (staging / "optimizer.pt").write_bytes(b"adam" * 100)
    return write_checkpoint(store, staging, staging / "model.safetensors", model=model, version=version, step=version,
                            format="full", offsets={"t:0": version}, trained_ids=[f"t{version}"], metrics={}).uri
