"""The s3:// checkpoint store against the real embedded object store: whole checkpoints only, checked downloads, a
bounded cache, and clear errors for refused credentials."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from agentstream.infra.checkpoint_store import (
    CheckpointCache,
    CheckpointError,
    DigestMismatch,
    FolderStore,
    S3Store,
    StoreAccessDenied,
    StoreUnreachable,
    open_store,
)
from agentstream.infra.config import CheckpointsConfig, ConfigError, Secret, describe, load_config
from agentstream.infra.files import sha256_file
from agentstream.trainer.checkpoint_writer import (
    ABANDONED_AFTER_S,
    checkpoint_name,
    latest_manifest,
    manifests,
    prune,
    read_manifest,
    recent_trained_ids,
)
from tests.support.s3_checkpoints import KEY_ID, LOCATION, SECRET, EmbeddedStore, s3_store, settings, write


@pytest.fixture
def embedded(tmp_path: Path):
    running = EmbeddedStore(tmp_path / "objects")
    yield running
    running.stop()


def test_put_get_round_trip_lists_prunes_and_uploads_large_files_in_parts(embedded: EmbeddedStore, tmp_path: Path):
    store = s3_store(embedded, tmp_path)
    big = os.urandom(12 << 20)  # over s3_multipart_mb = 5: three parts
    uris = [write(store, 1, big)] + [write(store, version, b"w%d" % version) for version in (2, 3)]
    assert uris[0] == f"{LOCATION}/m/v00000001"
    assert store.names("m") == [f"m/v0000000{v}" for v in (1, 2, 3)]
    assert [m.version for m in manifests(store, "m")] == [1, 2, 3]
    assert recent_trained_ids(store, "m", limit=2) == ["t2", "t3"]
    stored = embedded.object_path("checkpoints/m/v00000001/model.safetensors")
    assert stored.read_bytes() == big  # assembled from its parts
    folder = store.get(uris[0])
    assert (folder / "model.safetensors").read_bytes() == big
    assert (folder / "optimizer.pt").read_bytes() == b"adam" * 100
    manifest = read_manifest(store, checkpoint_name("m", 1))
    assert manifest.sha256 == sha256_file(folder / "model.safetensors") == manifest.files["model.safetensors"]
    assert set(manifest.files) == {"model.safetensors", "optimizer.pt"}
    assert store.get(uris[0]) == folder and store.downloads == 1  # the second get is served by the cache
    with pytest.raises(CheckpointError, match="already exists"):
        write(store, 1, b"again")
    prune(store, "m", keep=1)
    assert store.names("m") == ["m/v00000003"]
    assert not any(path.is_file() for path in embedded.object_path("checkpoints/m/v00000001").rglob("*"))
    assert latest_manifest(store, "m").version == 3


def test_a_corrupt_object_raises_a_named_error_and_leaves_the_cache_empty(embedded: EmbeddedStore, tmp_path: Path):
    store = s3_store(embedded, tmp_path)
    uri = write(store, 1, b"weights" * 1000)
    stored = embedded.object_path("checkpoints/m/v00000001/model.safetensors")
    corrupt = bytearray(stored.read_bytes())
    corrupt[100] ^= 0xFF
    stored.write_bytes(bytes(corrupt))
    with pytest.raises(DigestMismatch, match=r"model\.safetensors has sha256") as raised:
        store.get(uri)
    assert raised.value.retriable is False
    assert store.cache.entries() == []
    assert not any((store.cache.root / ".partial").iterdir())


def test_the_cache_keeps_its_bound_and_never_evicts_the_version_being_loaded(embedded: EmbeddedStore,
                                                                               tmp_path: Path):
    writer = s3_store(embedded, tmp_path, cache="writer")
    uris = [write(writer, version, os.urandom(100_000)) for version in (1, 2, 3, 4)]
    two = s3_store(embedded, tmp_path, cache="two", cache_max_versions=2)
    for uri in uris:
        two.get(uri)
    assert [path.name.split("-")[1] for path in two.cache.entries()] == ["v00000003", "v00000004"]
    two.get(uris[2])  # v3 is now the most recently used
    two.get(uris[0])
    assert [path.name.split("-")[1] for path in two.cache.entries()] == ["v00000003", "v00000001"]
    assert two.downloads == 5
    tiny = s3_store(embedded, tmp_path, cache="tiny", cache_max_gb=1e-6)  # 1 kB: less than one version
    for uri in uris[:2]:
        folder = tiny.get(uri)
        assert [path.name for path in tiny.cache.entries()] == [folder.name]
        assert (folder / "model.safetensors").stat().st_size == 100_000


def test_two_concurrent_gets_of_one_version_download_it_once(embedded: EmbeddedStore, tmp_path: Path):
    writer = s3_store(embedded, tmp_path, cache="writer")
    uri = write(writer, 1, os.urandom(8 << 20))
    readers = [s3_store(embedded, tmp_path, cache="shared") for _ in range(2)]  # two processes' stores, one cache
    start = threading.Barrier(2)
    folders: list[Path] = []

    def get(store: S3Store) -> None:
        start.wait()
        folders.append(store.get(uri))

    threads = [threading.Thread(target=get, args=(reader,)) for reader in readers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(folders) == 2 and folders[0] == folders[1]
    assert sum(reader.downloads for reader in readers) == 1
    assert sha256_file(folders[0] / "model.safetensors") == read_manifest(writer, "m/v00000001").sha256


def test_refused_credentials_and_a_missing_endpoint_are_clear_errors(embedded: EmbeddedStore, tmp_path: Path):
    wrong_secret = open_store(LOCATION, settings(embedded, tmp_path / "c", secret="not-the-secret"), tmp_path)
    with pytest.raises(StoreAccessDenied, match="refused the credentials") as raised:
        wrong_secret.names("m")
    message = str(raised.value)
    assert "403 SignatureDoesNotMatch" in message and KEY_ID in message and "not-the-secret" not in message
    assert not raised.value.retriable
    unknown = open_store(LOCATION, settings(embedded, tmp_path / "c", key_id="nobody"), tmp_path)
    with pytest.raises(StoreAccessDenied, match="403 InvalidAccessKeyId"):
        unknown.names("m")
    assert SECRET not in repr(settings(embedded, tmp_path / "c"))
    with pytest.raises(StoreUnreachable, match="no \\[checkpoints\\] s3_endpoint is set") as missing:
        open_store(LOCATION, CheckpointsConfig(), tmp_path / "no-stack")
    assert missing.value.retriable


def test_the_cache_is_whole_versions_only(tmp_path: Path):
    cache = CheckpointCache(tmp_path / "cache")

    def fails(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise StoreUnreachable("cut off")

    with pytest.raises(StoreUnreachable):
        cache.fetch("s3://b/p/m/v00000001", fails)
    assert cache.entries() == []
    folder = cache.fetch("s3://b/p/m/v00000001", lambda f: (f / "model.safetensors").write_bytes(b"whole"))
    assert folder.name.startswith("m-v00000001-") and (folder / "model.safetensors").read_bytes() == b"whole"


def test_fetches_of_different_versions_at_once_keep_the_bound_without_tripping_over_each_others_evictions(
        tmp_path: Path):
    """Hot swap over a fleet fetches one version per server at once: each eviction removes what the others list."""
    cache = CheckpointCache(tmp_path / "cache", max_versions=1)
    errors: list[BaseException] = []

    def fetch_many(thread: int) -> None:
        try:
            for version in range(40):
                uri = f"s3://b/p/m/v{thread:02d}{version:06d}"
                folder = cache.fetch(uri, lambda f: (f / "model.safetensors").write_bytes(b"w" * 1000))
                assert folder.name.startswith(f"m-v{thread:02d}{version:06d}-")
        except BaseException as error:  # the test asserts there were none
            errors.append(error)

    threads = [threading.Thread(target=fetch_many, args=(thread,)) for thread in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(cache.entries()) <= 4  # each thread's last version may be kept while it is handed out


def test_the_checkpoints_section_is_typed_and_its_secret_masked(tmp_path: Path):
    path = tmp_path / "agentstream.toml"
    path.write_text('[trainer]\ncheckpoint_dir = "s3://agentstream/checkpoints"\n[checkpoints]\n'
                    's3_access_key_id = "id"\ns3_secret_access_key = "hidden"\ncache_max_versions = 2\n')
    config = load_config(path, environ={"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000"})
    checkpoints = config.checkpoints
    assert (checkpoints.s3_endpoint, checkpoints.s3_access_key_id, checkpoints.cache_max_versions) == \
        ("http://127.0.0.1:9000", "id", 2)
    assert checkpoints.s3_secret_access_key == Secret("hidden") and "hidden" not in str(describe(config))
    assert load_config(tmp_path / "agentstream.toml", environ={}).checkpoints.s3_endpoint is None
    path.write_text('[checkpoints]\ns3_endpoint = "minio:9000"\n')
    with pytest.raises(ConfigError, match="must start with http"):
        load_config(path, environ={})


def test_a_held_version_is_not_evicted_until_the_block_ends(tmp_path: Path):
    """A model server reads the folder it is given: hot swap holds it while the server loads it."""
    cache = CheckpointCache(tmp_path / "cache", max_versions=1)

    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"w" * 1000)

    with cache.held("s3://b/p/m/v00000001", write) as folder:
        for version in (2, 3):
            cache.fetch(f"s3://b/p/m/v{version:08d}", write)
        assert (folder / "model.safetensors").read_bytes() == b"w" * 1000, "held through two evictions"
    cache.fetch("s3://b/p/m/v00000004", write)
    assert not folder.exists(), "evicted once released"
    assert [entry.name[:11] for entry in cache.entries()] == ["m-v00000004"]


def test_a_new_cache_removes_what_killed_fetches_left_but_not_a_fetch_under_way(tmp_path: Path):
    root = tmp_path / "cache"
    started, release = threading.Event(), threading.Event()

    def slow(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        started.set()
        release.wait(10)
        (folder / "model.safetensors").write_bytes(b"whole")

    fetching = threading.Thread(target=lambda: CheckpointCache(root).fetch("s3://b/p/m/v00000009", slow))
    fetching.start()
    assert started.wait(10)
    left = [root / ".partial" / "m-v00000001-0123456789ab.deadbeef", root / ".partial" / "evicted-cafe"]
    for folder in left:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"left by a killed process")
    cache = CheckpointCache(root)  # a process starting while another one fetches
    assert not any(folder.exists() for folder in left)
    assert len(list((root / ".partial").iterdir())) == 1, "the fetch under way keeps its partial folder"
    release.set()
    fetching.join(10)
    assert [(entry / "model.safetensors").read_bytes() for entry in cache.entries()] == [b"whole"]


def test_pruning_removes_uploads_a_killed_trainer_left_once_they_are_old(embedded: EmbeddedStore, tmp_path: Path):
    store = s3_store(embedded, tmp_path)
    write(store, 1, b"w1")
    hour_ago = time.time() - ABANDONED_AFTER_S - 60
    for version, when in ((2, hour_ago), (3, None)):  # v2 cut short an hour ago; v3 being uploaded right now
        for file in ("model.safetensors", "optimizer.pt"):
            path = embedded.object_path(f"checkpoints/m/v{version:08d}/{file}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"part")
            if when is not None:
                os.utime(path, (when, when))
    restarted = EmbeddedStore(embedded.root)  # the store indexes its files (and their times) as it starts
    try:
        store = s3_store(restarted, tmp_path, cache="cache-2")
        prune(store, "m", keep=5)
        assert not any(path.is_file() for path in embedded.object_path("checkpoints/m/v00000002").rglob("*"))
        assert embedded.object_path("checkpoints/m/v00000003/model.safetensors").is_file(), "an upload under way"
        assert store.names("m") == ["m/v00000001"]
    finally:
        restarted.stop()

    folders = FolderStore(tmp_path / "folders")
    old, fresh = folders.staging(), folders.staging()
    (old / "model.safetensors").write_bytes(b"half")
    os.utime(old / "model.safetensors", (hour_ago, hour_ago))
    os.utime(old, (hour_ago, hour_ago))
    (fresh / "model.safetensors").write_bytes(b"half")
    prune(folders, "m", keep=5)
    assert not old.exists() and fresh.exists()
