"""The checkpoint store: listing, pruning, the trained ids it remembers, and the stores it refuses."""

from __future__ import annotations

import pytest

from agentstream.trainer.checkpoint_writer import (
    CheckpointError,
    FolderStore,
    UnsupportedStore,
    copy_checkpoint,
    find_version,
    keep_only_newest,
    manifests,
    open_store,
    prune,
    recent_trained_ids,
    write_checkpoint,
)
from tests.support.small_disk import SmallDisk


def test_store_lists_prunes_and_remembers_trained_ids(tmp_path):
    store = FolderStore(tmp_path)
    for version in range(1, 5):
        staging = store.staging()
        (staging / "model.safetensors").write_bytes(b"w%d" % version)
        write_checkpoint(store, staging, staging / "model.safetensors", model="m", version=version, step=version,
                         format="full", offsets={}, trained_ids=[f"t{version}a", f"t{version}b"], metrics={})
    assert [m.version for m in manifests(store, "m")] == [1, 2, 3, 4]
    assert recent_trained_ids(store, "m", limit=3) == ["t3a", "t3b", "t4a", "t4b"]
    prune(store, "m", keep=2)
    assert [m.version for m in manifests(store, "m")] == [3, 4]
    assert find_version(store, 3).version == 3
    with pytest.raises(CheckpointError, match="no checkpoint of version 2"):
        find_version(store, 2)
    (store.root / "m" / "v00000004" / "optimizer.pt").write_bytes(b"adam")
    assert keep_only_newest(store, drop_files=("optimizer.pt",)) == [store.root / "m" / "v00000004"]
    assert [m.version for m in manifests(store, "m")] == [4]
    kept = sorted(p.name for p in (store.root / "m" / "v00000004").iterdir())
    assert kept == ["checkpoint.json", "model.safetensors"]
    with pytest.raises(UnsupportedStore, match=r"storage\.googleapis\.com"):  # the way to GCS is named
        open_store("gs://bucket/checkpoints")


def test_a_copy_the_disk_has_no_room_for_fails_and_leaves_no_staging_folder(tmp_path):
    source = FolderStore(tmp_path / "run")
    staging = source.staging()
    (staging / "model.safetensors").write_bytes(b"w" * 64 * 1024)
    manifest = write_checkpoint(source, staging, staging / "model.safetensors", model="m", version=3, step=6,
                                format="full", offsets={}, trained_ids=[], metrics={})
    disk = SmallDisk(tmp_path / "disk", 256 * 1024)
    try:
        target = FolderStore(disk.path / "copies")
        disk.fill(leave_bytes=16 * 1024)
        with pytest.raises(OSError, match="No space left on device"):
            copy_checkpoint(manifest, source, target)
        assert list(target.root.iterdir()) == []  # the half copy went with its staging folder
        disk.free()
        assert copy_checkpoint(manifest, source, target).version == 3
    finally:
        disk.unmount()
