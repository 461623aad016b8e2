"""The checkpoint store: listing, pruning, the trained ids it remembers, and the stores it refuses."""

from __future__ import annotations

import pytest

from agentstream.trainer.checkpoint_writer import (
    CheckpointError,
    FolderStore,
    UnsupportedStore,
    find_version,
    keep_only_newest,
    manifests,
    open_store,
    prune,
    recent_trained_ids,
    write_checkpoint,
)


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
