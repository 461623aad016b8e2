"""Checkpoints: weights (or an adapter) in safetensors with a sha256 and a manifest, in a store, announced on Kafka.

A checkpoint is a folder ``<model>/v<version>`` holding the weights file, the optimizer state
and ``checkpoint.json`` (the manifest). The manifest also records what a restart needs: the
Kafka positions up to which every transition is either in this checkpoint or was dropped, and
the ids of the transitions trained since the previous checkpoint (for deduplication across
restarts, and as the audit trail of what each version learnt from). The folder store writes a
checkpoint into a staging folder and renames it into place, so a crash never leaves half of one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import quote, unquote, urlsplit

from aiokafka import AIOKafkaProducer

from infra.config import Config
from infra.kafka import client_options, topic_name
from models.weights import local_path, sha256_file
from schemas import CHECKPOINT, AvroCodec
from schemas.checkpoint import Checkpoint
from schemas.errors import AgentstreamError

MANIFEST = "checkpoint.json"


class CheckpointError(AgentstreamError, RuntimeError):
    """A checkpoint cannot be written, found or read."""


class UnsupportedStore(CheckpointError):
    """The checkpoint location names a store this build does not implement (only folders and file:// URIs)."""


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds and where training stood when it was written."""

    model: str
    version: int
    step: int
    format: str
    weights_file: str
    sha256: str
    uri: str
    created_at_us: int
    offsets: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> next offset to read
    trained_ids: list[str] = field(default_factory=list)  # transitions trained since the previous checkpoint
    metrics: dict[str, float] = field(default_factory=dict)

    def checkpoint(self) -> Checkpoint:
        """The Checkpoint record announced for it (the event and the ``checkpoints`` row)."""
        return Checkpoint(model=self.model, version=self.version, uri=self.uri, sha256=self.sha256, step=self.step,
                          created_at_us=self.created_at_us, metrics=dict(self.metrics), format=self.format)


class CheckpointStore(Protocol):
    """Where checkpoint folders live: written locally, then ``put`` under a name; ``get`` gives a local folder back."""

    def staging(self) -> Path: ...

    def put(self, name: str, staging: Path) -> str: ...

    def get(self, uri: str) -> Path: ...

    def uri(self, name: str) -> str: ...

    def names(self, prefix: str) -> list[str]: ...

    def delete(self, name: str) -> None: ...


class FolderStore:
    """Checkpoints as folders under a root directory; ``put`` is an atomic rename and URIs are ``file://`` URIs."""

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def staging(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))

    def put(self, name: str, staging: Path) -> str:
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"checkpoint {target} already exists: is another trainer writing this model?")
        staging.chmod(0o755)
        staging.rename(target)
        return self.uri(name)

    def get(self, uri: str) -> Path:
        path = local_path(uri)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {uri} does not exist")
        return path

    def uri(self, name: str) -> str:
        return (self.root / name).as_uri()

    def names(self, prefix: str) -> list[str]:
        folder = self.root / prefix
        if not folder.is_dir():
            return []
        return sorted(f"{prefix}/{entry.name}" for entry in folder.iterdir()
                      if entry.is_dir() and (entry / MANIFEST).is_file())

    def delete(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)


def open_store(location: str) -> FolderStore:
    """The store for a folder path or a ``file://`` URI; object-store URIs (s3://, gs://) are refused for now."""
    parts = urlsplit(location)
    if parts.scheme in ("", "file"):
        return FolderStore(Path(unquote(parts.path) if parts.scheme else location))
    raise UnsupportedStore(f"checkpoint store {location!r}: only folders and file:// URIs are supported")


def checkpoint_name(model: str, version: int) -> str:
    """``<model>/v<version>``, the model name quoted so any name makes one safe folder."""
    return f"{model_folder(model)}/{_version_folder(version)}"


def _version_folder(version: int) -> str:
    return f"v{version:08d}"


def model_folder(model: str) -> str:
    return quote(model, safe="")


def write_checkpoint(store: CheckpointStore, staging: Path, weights: Path, *, model: str, version: int, step: int,
                     format: str, offsets: dict[str, int], trained_ids: list[str],
                     metrics: dict[str, float], sha256: str | None = None) -> Manifest:
    """Add the manifest to a staging folder that already holds the weights, and put it in the store.

    ``sha256`` is the weights file's digest when the writer computed it on the way (else it is read here).
    """
    name = checkpoint_name(model, version)
    manifest = Manifest(model=model, version=version, step=step, format=format, weights_file=weights.name,
                        sha256=sha256 or sha256_file(weights), uri=store.uri(name),
                        created_at_us=time.time_ns() // 1000, offsets=offsets, trained_ids=trained_ids, metrics=metrics)
    (staging / MANIFEST).write_text(json.dumps(asdict(manifest)))
    store.put(name, staging)
    return manifest


def read_manifest(store: CheckpointStore, name: str) -> Manifest:
    path = store.get(store.uri(name)) / MANIFEST
    try:
        return Manifest(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None


def manifests(store: CheckpointStore, model: str) -> list[Manifest]:
    """Every checkpoint of ``model`` in the store, oldest first."""
    return [read_manifest(store, name) for name in store.names(model_folder(model))]


def latest_manifest(store: CheckpointStore, model: str) -> Manifest | None:
    names = store.names(model_folder(model))
    return read_manifest(store, names[-1]) if names else None


def recent_trained_ids(store: CheckpointStore, model: str, limit: int) -> list[str]:
    """Ids trained in the newest checkpoints of ``model``, oldest first, about ``limit`` of them."""
    collected: list[list[str]] = []
    count = 0
    for name in reversed(store.names(model_folder(model))):
        if count >= limit:
            break
        ids = read_manifest(store, name).trained_ids
        collected.append(ids)
        count += len(ids)
    return [transition_id for ids in reversed(collected) for transition_id in ids]


def prune(store: CheckpointStore, model: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints of ``model`` (0 keeps everything)."""
    _prune_folder(store, model_folder(model), keep)


def _prune_folder(store: CheckpointStore, folder: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints under ``folder`` (0 keeps everything); returns those left."""
    names = store.names(folder)
    if keep > 0:
        for name in names[:-keep]:
            store.delete(name)
        names = names[-keep:]
    return names


def keep_only_newest(store: FolderStore, drop_files: tuple[str, ...] = ()) -> list[Path]:
    """Delete all but each model's newest checkpoint, and the named files (e.g. optimizer state) from that one.

    For a run that is over: a SmolLM2 checkpoint with its AdamW state takes 1.6 GB, and a demo
    keeps three of them while it runs. Returns the folders kept.
    """
    kept = []
    for model in _model_folders(store):
        for name in _prune_folder(store, model, keep=1):
            folder = store.root / name
            for file in drop_files:
                (folder / file).unlink(missing_ok=True)
            kept.append(folder)
    return kept


def find_version(store: FolderStore, version: int) -> Manifest:
    """The checkpoint of ``version`` in a store that holds one model's checkpoints (a demo's), whatever its name."""
    for folder in _model_folders(store):
        name = f"{folder}/{_version_folder(version)}"
        if name in store.names(folder):
            return read_manifest(store, name)
    raise CheckpointError(f"no checkpoint of version {version} in {store.root}")


def _model_folders(store: FolderStore) -> list[str]:
    return sorted(entry.name for entry in store.root.iterdir() if entry.is_dir() and not entry.name.startswith("."))


class CheckpointAnnouncer:
    """Publishes Checkpoint events, keyed by model, on the compacted checkpoints topic."""

    def __init__(self, config: Config, bootstrap_servers: str) -> None:
        self.topic = topic_name(config.topics, "checkpoints")
        self.codec = AvroCodec()
        self._producer = AIOKafkaProducer(**client_options(config.kafka, bootstrap_servers), acks="all")

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def announce(self, manifest: Manifest) -> None:
        """Publish and wait for the broker's acknowledgement."""
        await self._producer.send_and_wait(self.topic, key=manifest.model.encode(),
                                           value=self.codec.encode(CHECKPOINT, manifest.checkpoint().record()))
