"""Checkpoint stores by URL: a folder, or ``s3://bucket/prefix`` on any S3 API, and the local cache readers load from.

A checkpoint is a folder ``<model>/v<version>`` of files, the manifest ``checkpoint.json`` among
them. A store takes a staging folder with ``put(name, staging)``; ``get(uri)`` gives back a
folder on this machine, which is what the trainer resumes from and hot swap hands the model
server (vLLM is given a path on its own disk).

- :class:`FolderStore` keeps folders under a root directory; ``put`` is one atomic rename.
- :class:`S3Store` keeps each file as an object ``<prefix>/<model>/v<version>/<file>``. ``put``
  uploads every other file first and the manifest last, so a checkpoint whose manifest is
  absent does not exist (``names`` lists only those with one): an uploader killed halfway leaves
  objects nobody reads, and the trainer announces a version only after ``put`` returned. The
  manifest ``put`` uploads also lists each file's sha256 (``files``). ``get`` downloads a version
  once into a :class:`CheckpointCache`, checks every file against those digests (the weights
  file also against the manifest's ``sha256``, the one the Checkpoint event carries), and
  returns the cached folder.

It lives in infra, beside the Kafka and ClickHouse clients, so that the trainer (which writes)
and serving's hot swap (which reads) both reach it. The S3 client is boto3 (credential chain,
retries, multipart uploads, signatures that AWS, MinIO, GCS's XML API and the stack's embedded
store all accept), imported only where an ``s3://`` store is opened.

It is one module of about 500 lines on purpose: both stores and the cache keep one rule (a checkpoint without
its manifest does not exist, every file is checked against the manifest's digests), which reads best in one place.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, unquote, urlsplit

from agentstream.infra.config import CHECKPOINT_BUCKET, OBJECTSTORE_SERVICE, CheckpointsConfig
from agentstream.infra.files import CHUNK, local_path, sha256_file
from agentstream.infra.processes import ServiceDirectory
from agentstream.schemas.errors import AgentstreamError

MANIFEST = "checkpoint.json"
EMBEDDED_KEYS = ("agentstream", "agentstream-local")
"""The placeholder keys the stack's embedded store is called with (it runs on loopback and checks none)."""


class CheckpointError(AgentstreamError, RuntimeError):
    """A checkpoint cannot be written, found or read."""


class UnsupportedStore(CheckpointError):
    """The checkpoint location names a store this build does not implement (folders, file:// and s3:// URIs)."""


class CheckpointNotFound(CheckpointError):
    """The store holds no such checkpoint or file (a checkpoint whose manifest is absent does not exist)."""


class StoreUnreachable(CheckpointError):
    """The object store did not answer, or answered a server error: the same call may succeed later."""

    retriable = True


class StoreAccessDenied(CheckpointError):
    """The object store refused the credentials (unknown key, bad signature, no permission) or none were found."""


class DigestMismatch(CheckpointError):
    """A downloaded file's sha256 differs from the manifest's: the stored object is not what was written.

    Not retriable: S3 transfers are checked end to end by TCP and TLS, so a mismatch is almost
    always in the stored object itself, and the same download gives the same bytes.
    """


class CheckpointStore(Protocol):
    """Where checkpoint folders live: written locally, then ``put`` under a name; ``get`` gives a local folder back."""

    def staging(self) -> Path: ...

    def put(self, name: str, staging: Path) -> str: ...

    def get(self, uri: str) -> Path: ...

    def read(self, name: str, file: str) -> bytes: ...

    def uri(self, name: str) -> str: ...

    def names(self, prefix: str) -> list[str]: ...

    def delete(self, name: str) -> None: ...

    def remove_abandoned(self, prefix: str, older_than_s: float) -> list[str]: ...


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

    def read(self, name: str, file: str) -> bytes:
        path = self.root / name / file
        try:
            return path.read_bytes()
        except OSError as error:
            raise CheckpointError(f"cannot read {path}: {error}") from None

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

    def remove_abandoned(self, prefix: str, older_than_s: float) -> list[str]:
        """Remove staging folders untouched for ``older_than_s`` (their writer was killed); their paths."""
        cutoff = time.time() - older_than_s
        removed = []
        for staging in self.root.glob(".staging-*"):
            if staging.is_dir() and _newest_mtime(staging) < cutoff:
                shutil.rmtree(staging, ignore_errors=True)
                removed.append(str(staging))
        return removed


def open_store(location: str, settings: CheckpointsConfig | None = None, home: Path | None = None
               ) -> FolderStore | S3Store:
    """The store for a folder path, a ``file://`` URI or an ``s3://bucket/prefix`` URI (reached per ``settings``).

    ``home`` is the stack home: where the embedded object store's address is found when
    ``settings.s3_endpoint`` is empty, and the default cache folder.
    """
    parts = urlsplit(location)
    if parts.scheme in ("", "file"):
        return FolderStore(Path(unquote(parts.path) if parts.scheme else location))
    if parts.scheme == "s3":
        settings = settings or CheckpointsConfig()
        home = home or Path(".agentstream")
        return S3Store(location, settings, home, cache_for(settings, home))
    hint = (" (Google Cloud Storage: s3://bucket/prefix with [checkpoints] s3_endpoint = "
            "\"https://storage.googleapis.com\" and HMAC keys)" if location.startswith("gs://") else "")
    raise UnsupportedStore(f"checkpoint store {location!r}: only folders, file:// and s3:// URIs are supported{hint}")


def cache_for(settings: CheckpointsConfig, home: Path) -> CheckpointCache:
    """The local cache of ``settings`` (default ``<home>/checkpoint-cache``)."""
    root = Path(settings.cache_dir) if settings.cache_dir else home / "checkpoint-cache"
    return CheckpointCache(root, max_bytes=int(settings.cache_max_gb * 1e9), max_versions=settings.cache_max_versions)


class CheckpointReader:
    """A local folder for any checkpoint URI on this machine: a path as it is, an ``s3://`` one through the cache.

    Hot swap and other readers hold one; S3 stores are opened once per bucket.
    """

    def __init__(self, settings: CheckpointsConfig, home: Path) -> None:
        self.settings = settings
        self.home = home
        self._stores: dict[str, S3Store] = {}

    def local_folder(self, uri: str) -> Path:
        """The folder of the checkpoint at ``uri`` here (downloaded and checked first for an ``s3://`` URI)."""
        store = self._s3_store(uri)
        return local_path(uri) if store is None else store.get(uri)

    @contextlib.contextmanager
    def holding(self, uri: str) -> Iterator[Path]:
        """``local_folder``, kept from the cache's evictions until the block ends: a server loading it reads it all."""
        store = self._s3_store(uri)
        if store is None:
            yield local_path(uri)
            return
        with store.held(uri) as folder:
            yield folder

    def _s3_store(self, uri: str) -> S3Store | None:
        """The store of an ``s3://`` URI's bucket (opened once), or None for a local folder."""
        parts = urlsplit(uri)
        if parts.scheme in ("", "file"):
            return None
        if parts.scheme != "s3":
            raise UnsupportedStore(f"checkpoint {uri!r}: only folders, file:// and s3:// URIs can be read")
        store = self._stores.get(parts.netloc)
        if store is None:
            store = self._stores[parts.netloc] = S3Store(f"s3://{parts.netloc}", self.settings, self.home,
                                                         cache_for(self.settings, self.home))
        return store

    @staticmethod
    def is_local(uri: str) -> bool:
        return urlsplit(uri).scheme in ("", "file")


# ---------------------------------------------------------------------------------------------- S3


class S3Store:
    """Checkpoints as objects under ``s3://bucket/prefix`` on any S3 API; ``get`` goes through the local cache."""

    def __init__(self, location: str, settings: CheckpointsConfig, home: Path, cache: CheckpointCache) -> None:
        parts = urlsplit(location)
        if not parts.netloc:
            raise UnsupportedStore(f"checkpoint store {location!r}: an s3:// URI names a bucket (s3://bucket/prefix)")
        self.bucket = parts.netloc
        self.prefix = unquote(parts.path).strip("/")
        self.cache = cache
        self.downloads = 0  # versions this store downloaded (the cache serves the rest)
        self.endpoint, embedded = _endpoint(settings, home)
        self.multipart_bytes = settings.s3_multipart_mb << 20
        self.key_id = settings.s3_access_key_id or (EMBEDDED_KEYS[0] if embedded else None)  # never the secret
        self._client = _client(settings, self.endpoint, embedded)

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.bucket}/{self.prefix} at {self.endpoint or 'AWS'})"

    # -- names and keys

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{quote(self._key(name))}"

    def _object(self, uri: str) -> tuple[str, str]:
        parts = urlsplit(uri)
        if parts.scheme != "s3" or not parts.netloc:
            raise CheckpointError(f"{uri!r} is not an s3:// checkpoint URI")
        return parts.netloc, unquote(parts.path).strip("/")

    # -- writing

    def staging(self) -> Path:
        self.cache.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".staging-", dir=self.cache.root))

    def put(self, name: str, staging: Path) -> str:
        """Upload a staging folder as ``name``: every file, then the manifest (with each file's sha256) last."""
        key = self._key(name)
        try:
            if self._exists(self.bucket, f"{key}/{MANIFEST}"):
                raise CheckpointError(f"checkpoint {self.uri(name)} already exists: is another trainer writing "
                                      "this model?")
            manifest = json.loads((staging / MANIFEST).read_text())
            files = sorted(path for path in staging.rglob("*") if path.is_file() and path.name != MANIFEST)
            digests = {}
            for path in files:
                file = path.relative_to(staging).as_posix()
                known = manifest.get("sha256") if file == manifest.get("weights_file") else None
                digests[file] = self._upload(path, f"{key}/{file}", known)
            manifest["files"] = digests
            body = json.dumps(manifest).encode()
            self._call("put", lambda: self._client.put_object(Bucket=self.bucket, Key=f"{key}/{MANIFEST}", Body=body))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.uri(name)

    def _upload(self, path: Path, key: str, sha256: str | None) -> str:
        """Upload one file (in parts when it is large and the store takes them); returns its sha256."""
        from boto3.s3.transfer import TransferConfig

        digest = sha256 or sha256_file(path)
        threshold = self.multipart_bytes or 5 << 30
        config = TransferConfig(multipart_threshold=threshold, multipart_chunksize=self.multipart_bytes or threshold)
        self._call("upload", lambda: self._client.upload_file(str(path), self.bucket, key, Config=config))
        return digest

    # -- reading

    def read(self, name: str, file: str) -> bytes:
        key = f"{self._key(name)}/{file}"
        return self._call("read", lambda: self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read(),
                          missing=f"{self.uri(name)}/{file} does not exist")

    def get(self, uri: str) -> Path:
        """The checkpoint's folder on this machine, downloaded (once) into the cache and checked."""
        bucket, key = self._object(uri)
        return self.cache.fetch(uri, lambda folder: self._download(bucket, key, folder))

    def held(self, uri: str) -> contextlib.AbstractContextManager[Path]:
        """``get``, with the folder kept from eviction until the block ends (while a model server loads it)."""
        bucket, key = self._object(uri)
        return self.cache.held(uri, lambda folder: self._download(bucket, key, folder))

    def _download(self, bucket: str, key: str, folder: Path) -> None:
        uri = f"s3://{bucket}/{key}"
        body = self._call("read", lambda: self._client.get_object(Bucket=bucket, Key=f"{key}/{MANIFEST}")["Body"]
                          .read(), missing=f"checkpoint {uri} does not exist (no {MANIFEST})")
        try:
            manifest = json.loads(body)
            files: dict[str, str] = dict(manifest.get("files") or {})
        except (ValueError, TypeError, AttributeError) as error:
            raise CheckpointError(f"cannot read {uri}/{MANIFEST}: {error}") from None
        if not files and manifest.get("weights_file"):  # written by another tool: the weights file at least
            files = {manifest["weights_file"]: manifest.get("sha256", "")}
        weights, expected = manifest.get("weights_file"), manifest.get("sha256")
        if weights in files and expected and files[weights] != expected:
            raise DigestMismatch(f"{uri}/{MANIFEST} lists {weights} with sha256 {files[weights]}, the checkpoint "
                                 f"says {expected}")
        self.downloads += 1
        for file, sha256 in files.items():
            target = folder / file
            if file.startswith("/") or ".." in file.split("/"):
                raise CheckpointError(f"{uri}/{MANIFEST} names a file outside its folder: {file!r}")
            target.parent.mkdir(parents=True, exist_ok=True)
            actual = self._call("read", partial(_stream_to, self._client, bucket, f"{key}/{file}", target),
                                missing=f"{uri}/{file} is listed in its manifest but not stored")
            if sha256 and actual != sha256:
                raise DigestMismatch(f"{uri}/{file} has sha256 {actual}, its manifest says {sha256}")
        (folder / MANIFEST).write_bytes(body)

    def _exists(self, bucket: str, key: str) -> bool:
        try:
            self._call("check", lambda: self._client.head_object(Bucket=bucket, Key=key), missing=key)
        except CheckpointNotFound:
            return False
        return True

    # -- listing and deleting

    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        """The listing entries (Key, LastModified, ...) of the objects under ``prefix``."""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = self._call("list", lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=prefix)))
        for page in pages:
            yield from page.get("Contents") or ()

    def _keys(self, prefix: str) -> Iterator[str]:
        return (entry["Key"] for entry in self._objects(prefix))

    def names(self, prefix: str) -> list[str]:
        """The checkpoints under ``prefix`` (one model's folder) whose manifest is stored, oldest first."""
        folder = self._key(prefix) + "/"
        found = []
        for key in self._keys(folder):
            version, _, file = key[len(folder):].partition("/")
            if file == MANIFEST:
                found.append(f"{prefix}/{version}")
        return sorted(found)

    def delete(self, name: str) -> None:
        """Delete a checkpoint, its manifest first (a checkpoint half deleted is no longer listed)."""
        key = self._key(name)
        manifest = f"{key}/{MANIFEST}"
        self._call("delete", lambda: self._client.delete_object(Bucket=self.bucket, Key=manifest))
        for other in list(self._keys(key + "/")):
            self._call("delete", partial(self._client.delete_object, Bucket=self.bucket, Key=other))

    def remove_abandoned(self, prefix: str, older_than_s: float) -> list[str]:
        """Delete the objects of versions under ``prefix`` that have no manifest and no object newer than
        ``older_than_s`` (an upload its trainer never finished); the names removed."""
        folder = self._key(prefix) + "/"
        versions: dict[str, list[tuple[str, float]]] = {}
        for entry in self._objects(folder):
            version, _, file = entry["Key"][len(folder):].partition("/")
            versions.setdefault(version, []).append((file, entry["LastModified"].timestamp()))
        cutoff = time.time() - older_than_s
        removed = []
        for version, objects in sorted(versions.items()):
            if all(file != MANIFEST for file, _ in objects) and max(at for _, at in objects) < cutoff:
                for file, _ in objects:
                    self._call("delete", partial(self._client.delete_object, Bucket=self.bucket,
                                                 Key=f"{folder}{version}/{file}"))
                removed.append(f"{prefix}/{version}")
        return removed

    # -- errors

    def _call(self, action: str, call: Callable[[], Any], missing: str | None = None) -> Any:
        """Run one client call, its failures as named errors (the secret never appears in one)."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

        try:
            return call()
        except ClientError as error:
            if missing is not None and _status(error) == 404:
                raise CheckpointNotFound(missing) from None
            raise self._error(action, error) from None
        except (NoCredentialsError, PartialCredentialsError):
            raise StoreAccessDenied(f"{self!r}: no credentials: set [checkpoints] s3_access_key_id and "
                                    "s3_secret_access_key, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
        except BotoCoreError as error:  # connection refused, timeouts, a body cut short
            raise StoreUnreachable(f"{self!r}: {action} failed: {error}") from None

    def _error(self, action: str, error: Any) -> CheckpointError:
        status = _status(error)
        code = error.response.get("Error", {}).get("Code", "")
        message = f"{self!r}: {action} answered HTTP {status} {code}".rstrip()
        if status in (401, 403):
            return StoreAccessDenied(f"{message}: the store refused the credentials (key id "
                                     f"{self.key_id or 'from the AWS chain'}); check [checkpoints] "
                                     "s3_access_key_id/s3_secret_access_key or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        if status >= 500 or status in (408, 429):
            return StoreUnreachable(message)
        return CheckpointError(message)


def _status(error: Any) -> int:
    return int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _stream_to(client: Any, bucket: str, key: str, target: Path) -> str:
    """Download one object into ``target``, hashing it on the way; returns its sha256."""
    digest = hashlib.sha256()
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    with open(target, "wb") as handle:
        for chunk in body.iter_chunks(CHUNK):
            handle.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def _endpoint(settings: CheckpointsConfig, home: Path) -> tuple[str | None, bool]:
    """(the endpoint URL, whether it is the stack's embedded store): the configured one, else the running stack's."""
    if settings.s3_endpoint:
        return settings.s3_endpoint, False
    record = ServiceDirectory(home).record(OBJECTSTORE_SERVICE)
    if record is not None and record.alive():
        return f"http://{record.address}", True
    raise StoreUnreachable(f"no [checkpoints] s3_endpoint is set and no local stack object store runs under {home} "
                           f"(`agentstream up` serves s3://{CHECKPOINT_BUCKET}/...); name the S3 API to use, e.g. "
                           "s3_endpoint = \"https://s3.eu-west-1.amazonaws.com\"")


def _client(settings: CheckpointsConfig, endpoint: str | None, embedded: bool) -> Any:
    try:
        import boto3
        from botocore.config import Config as BotoConfig
    except ImportError:
        raise UnsupportedStore("s3:// checkpoint stores need boto3: pip install 'agentstream[train]'") from None

    key_id, secret = settings.s3_access_key_id, settings.s3_secret_access_key
    credentials: dict[str, str] = {}
    if key_id and secret is not None:
        credentials = {"aws_access_key_id": key_id, "aws_secret_access_key": secret.reveal()}
    elif embedded:
        credentials = {"aws_access_key_id": EMBEDDED_KEYS[0], "aws_secret_access_key": EMBEDDED_KEYS[1]}
    session = boto3.session.Session()
    region = settings.s3_region or session.region_name or "us-east-1"
    config = BotoConfig(
        s3={"addressing_style": "path" if endpoint else "auto"},
        retries={"max_attempts": 4, "mode": "standard"},
        connect_timeout=10, read_timeout=120,
        # we check sha256 ourselves; CRC trailers (botocore's default since 1.36) are not taken by every S3 API
        request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return session.client("s3", endpoint_url=endpoint, region_name=region, config=config, **credentials)


# ---------------------------------------------------------------------------------------------- cache


class CheckpointCache:
    """Downloaded checkpoint folders under ``root``, bounded in bytes and versions, least recently used out first.

    :meth:`fetch` downloads a version into a partial folder and renames it into place only once
    every file is there and checked, so a cached folder is always whole; a download that fails
    leaves nothing. One lock file per version (``flock``) makes concurrent fetches of one
    version, in threads or in processes, wait for a single download. After a fetch, whole
    versions are evicted, least recently fetched first, until the cache is within its bounds;
    the version just fetched and any version another fetch holds are never evicted. Evictions
    take turns (one more lock file): each removes folders the others would list and measure.
    """

    def __init__(self, root: Path, max_bytes: int = 0, max_versions: int = 0) -> None:
        self.root = root.expanduser().resolve()
        self.max_bytes = max_bytes
        self.max_versions = max_versions
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Remove the partial folders of fetches a killed process left; a live fetch holds its version's lock."""
        partials = self.root / ".partial"
        if not partials.is_dir():
            return
        for leftover in partials.iterdir():
            version = leftover.name.rpartition(".")[0] or leftover.name
            with self._locked(version, wait=False) as free:
                if free:
                    shutil.rmtree(leftover, ignore_errors=True)

    def entry(self, uri: str) -> Path:
        """The folder a version is cached in: its URI's last two segments (readable) and a hash of the whole URI."""
        tail = "-".join(urlsplit(uri).path.rstrip("/").split("/")[-2:])
        safe = "".join(c if c.isalnum() or c in "-_.@" else "_" for c in unquote(tail))[:80]
        return self.root / f"{safe}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"

    def fetch(self, uri: str, download: Callable[[Path], None]) -> Path:
        """The cached folder of ``uri``, calling ``download(folder)`` to fill a fresh folder when it is not cached."""
        entry = self.entry(uri)
        with self._locked(entry.name):
            if not entry.is_dir():
                partial = self.root / ".partial" / f"{entry.name}.{uuid.uuid4().hex}"  # found by its version's lock
                partial.mkdir(parents=True)
                try:
                    download(partial)
                    partial.rename(entry)
                finally:
                    shutil.rmtree(partial, ignore_errors=True)
            now = time.time_ns()  # most recently used (the kernel's own "now" ticks too coarsely to order fetches)
            os.utime(entry, ns=(now, now))
            self._evict(keep=entry)
        return entry

    @contextlib.contextmanager
    def held(self, uri: str, download: Callable[[Path], None]) -> Iterator[Path]:
        """The cached folder of ``uri`` (fetched if need be), never evicted until the block ends (a shared lock)."""
        entry = self.entry(uri)
        while True:
            with self._locked(entry.name, shared=True):
                if entry.is_dir():
                    yield entry
                    return
            self.fetch(uri, download)  # then hold it; an eviction between the two means one more turn

    def entries(self) -> list[Path]:
        """The cached versions, least recently used first."""
        if not self.root.is_dir():
            return []
        found = [path for path in self.root.iterdir() if path.is_dir() and not path.name.startswith(".")]
        return sorted(found, key=lambda path: path.stat().st_mtime_ns)

    def _evict(self, keep: Path) -> None:
        with self._locked(".evicting"):
            self._evict_in_turn(keep)

    def _evict_in_turn(self, keep: Path) -> None:
        entries = self.entries()
        sizes = {path: _size(path) for path in entries}
        total = sum(sizes.values())
        count = len(entries)
        for path in entries:
            over_bytes = self.max_bytes > 0 and total > self.max_bytes
            over_count = self.max_versions > 0 and count > self.max_versions
            if not (over_bytes or over_count):
                return
            if path == keep:
                continue
            with self._locked(path.name, wait=False) as held:
                if not held:  # another fetch is handing it out right now
                    continue
                trash = self.root / ".partial" / f"evicted-{uuid.uuid4().hex}"
                trash.parent.mkdir(parents=True, exist_ok=True)
                path.rename(trash)  # gone from the cache at once; the files after
                shutil.rmtree(trash, ignore_errors=True)
            total -= sizes[path]
            count -= 1

    @contextlib.contextmanager
    def _locked(self, name: str, wait: bool = True, shared: bool = False) -> Iterator[bool]:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{name}.lock", "a") as handle:
            try:
                fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _newest_mtime(folder: Path) -> float:
    return max((path.stat().st_mtime for path in folder.rglob("*")), default=folder.stat().st_mtime)


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())

