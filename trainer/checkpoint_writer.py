"""Checkpoints: weights (or an adapter) in safetensors with a sha256 and a manifest, in a store, announced on Kafka.

A checkpoint is a folder ``<model>/v<version>`` holding the weights file, the optimizer state
and ``checkpoint.json`` (the manifest). The manifest also records what a restart needs: the
Kafka positions up to which every transition is either in this checkpoint or was dropped, and
the ids of the transitions trained since the previous checkpoint (for deduplication across
restarts, and as the audit trail of what each version learnt from). The stores (a folder, or
``s3://`` on any S3 API) are in ``infra/checkpoint_store.py``: neither announces a checkpoint
that is not whole, and the trainer announces one only after ``put`` returned.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote

from aiokafka import AIOKafkaProducer

from agentstream.infra.checkpoint_store import MANIFEST as MANIFEST
from agentstream.infra.checkpoint_store import CheckpointError as CheckpointError
from agentstream.infra.checkpoint_store import CheckpointStore as CheckpointStore
from agentstream.infra.checkpoint_store import FolderStore as FolderStore
from agentstream.infra.checkpoint_store import UnsupportedStore as UnsupportedStore
from agentstream.infra.checkpoint_store import open_store as open_store
from agentstream.infra.config import Config
from agentstream.infra.files import sha256_file
from agentstream.infra.kafka import client_options, start_producer, topic_name
from agentstream.schemas import CHECKPOINT, AvroCodec
from agentstream.schemas.checkpoint import Checkpoint

log = logging.getLogger("agentstream.trainer.checkpoints")

ABANDONED_AFTER_S = 3600
"""An upload without a manifest untouched this long was cut short (a killed trainer): pruning removes it."""


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
    files: dict[str, str] = field(default_factory=dict)  # file -> sha256, filled by stores that download (s3://)

    def checkpoint(self) -> Checkpoint:
        """The Checkpoint record announced for it (the event and the ``checkpoints`` row)."""
        return Checkpoint(model=self.model, version=self.version, uri=self.uri, sha256=self.sha256, step=self.step,
                          created_at_us=self.created_at_us, metrics=dict(self.metrics), format=self.format)


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
    """The manifest of checkpoint ``name``, read alone (an s3:// store does not download the weights for it)."""
    try:
        return Manifest(**json.loads(store.read(name, MANIFEST)))
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"cannot read {store.uri(name)}/{MANIFEST}: {error}") from None


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
    """Delete all but the newest ``keep`` checkpoints under ``folder`` (0 keeps everything), and what killed uploads
    left there; returns the checkpoints left."""
    for abandoned in store.remove_abandoned(folder, ABANDONED_AFTER_S):
        log.warning("removed %s: an upload without a manifest, untouched for %d s (its writer was killed)",
                    abandoned, ABANDONED_AFTER_S)
    names = store.names(folder)
    if keep > 0:
        for name in names[:-keep]:
            store.delete(name)
        names = names[-keep:]
    return names


def keep_only_newest(store: CheckpointStore, drop_files: tuple[str, ...] = ()) -> list[Path]:
    """Delete all but each model's newest checkpoint, and the named files (e.g. optimizer state) from that one.

    For a run that is over: a SmolLM2 checkpoint with its AdamW state takes 1.6 GB, and a demo
    keeps three of them while it runs. Returns the folders kept. Folder stores only (a demo's).
    """
    store = _folder_store(store)
    kept = []
    for model in _model_folders(store):
        for name in _prune_folder(store, model, keep=1):
            folder = store.root / name
            for file in drop_files:
                (folder / file).unlink(missing_ok=True)
            kept.append(folder)
    return kept


def find_version(store: CheckpointStore, version: int) -> Manifest:
    """The checkpoint of ``version`` in a folder store that holds one model's checkpoints (a demo's), whatever its
    name."""
    store = _folder_store(store)
    for folder in _model_folders(store):
        name = f"{folder}/{_version_folder(version)}"
        if name in store.names(folder):
            return read_manifest(store, name)
    raise CheckpointError(f"no checkpoint of version {version} in {store.root}")


def copy_checkpoint(manifest: Manifest, source: CheckpointStore, target: CheckpointStore) -> Manifest:
    """A copy of a checkpoint in another store, to start another run from: the same weights, version and step.

    The copy keeps no Kafka positions and no trained ids: they are the positions in, and the ids of, the topics of
    the run that wrote it. Every file goes, the optimizer state with the weights where there is one. The checkpoint
    is found by its name in ``source``, not by its manifest's URI: a folder store may have moved.
    """
    folder = source.get(source.uri(checkpoint_name(manifest.model, manifest.version)))
    staging = target.staging()
    try:
        for file in folder.iterdir():
            if file.is_file() and file.name != MANIFEST:
                shutil.copy2(file, staging / file.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a full disk keeps no half copy (a model's size) behind
        raise
    return write_checkpoint(target, staging, staging / manifest.weights_file, model=manifest.model,
                            version=manifest.version, step=manifest.step, format=manifest.format, offsets={},
                            trained_ids=[], metrics=manifest.metrics, sha256=manifest.sha256)


def _folder_store(store: CheckpointStore) -> FolderStore:
    if not isinstance(store, FolderStore):
        raise CheckpointError(f"{store!r}: this works on a folder store only")
    return store


def _model_folders(store: FolderStore) -> list[str]:
    return sorted(entry.name for entry in store.root.iterdir() if entry.is_dir() and not entry.name.startswith("."))


class CheckpointAnnouncer:
    """Publishes Checkpoint events, keyed by model, on the compacted checkpoints topic."""

    def __init__(self, config: Config, bootstrap_servers: str) -> None:
        self.topic = topic_name(config.topics, "checkpoints")
        self.codec = AvroCodec()
        self._kafka, self._options = config.kafka, client_options(config.kafka, bootstrap_servers)
        self._producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        self._producer = await start_producer(self._kafka, self._options)

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()

    async def announce(self, manifest: Manifest) -> None:
        """Publish and wait for the broker's acknowledgement."""
        assert self._producer is not None, "CheckpointAnnouncer.announce before start"
        await self._producer.send_and_wait(self.topic, key=manifest.model.encode(),
                                           value=self.codec.encode(CHECKPOINT, manifest.checkpoint().record()))
