"""The store's buckets on disk: one plain file per object, written durably, listed in key order.

Every write lands in a temporary file, is fsynced, renamed into place and its directory fsynced, so an
object the store has answered for survives a SIGKILL or a power cut."""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from agentstream.schemas.errors import AgentstreamError

LOCK_STRIPES = 64
TEMPORARY = ".tmp"


class S3Error(AgentstreamError):
    """A request the store refuses, with the S3 error code and HTTP status a client expects."""

    def __init__(self, status: int, code: str, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.key = key



@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one object without reading it."""

    size: int
    modified: float  # seconds since the epoch
    etag: str | None  # quoted MD5 hex; None until the content has been read once after a restart


def quote_etag(digest: str) -> str:
    return f'"{digest}"'


def _etag_matches(header: str, etag: str) -> bool:
    """Whether an ``If-Match``/``If-None-Match`` header (a list of tags or ``*``) names ``etag``."""
    wanted = {tag.strip().removeprefix("W/") for tag in header.split(",")}
    return "*" in wanted or etag in wanted or etag.strip('"') in wanted


class WritesInFlight:
    """The PUTs a bucket has received but not answered yet, so that a listing can wait for those before it.

    tansu numbers a record batch before it stores it, and concurrent producers' batches for one
    partition can finish out of order here (each is fsynced: measured 586.batch stored 3 ms before
    585.batch). A fetch that listed the partition in between was served the later batch and the
    consumer moved past the earlier one for good (2 of 1,200 records skipped with 4 producers on one
    partition, and 2 acknowledged spans in a chaos soak). A listing therefore waits until every write
    under its prefix that arrived before it is answered.
    """

    def __init__(self) -> None:
        self._writes: list[tuple[str, asyncio.Future[None]]] = []

    def begin(self, key: str) -> asyncio.Future[None]:
        """A PUT of ``key`` arrived; call :meth:`end` with the returned handle once it is answered."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writes.append((key, done))
        return done

    def end(self, done: asyncio.Future[None]) -> None:
        done.set_result(None)
        self._writes = [(key, write) for key, write in self._writes if write is not done]

    async def settle(self, prefix: str) -> None:
        """Return once the writes under ``prefix`` that arrived before this call are answered."""
        earlier = [done for key, done in self._writes if key.startswith(prefix)]
        if earlier:
            await asyncio.wait(earlier)


class Bucket:
    """The objects of one bucket: files under one folder, and a sorted in-memory index of their keys.

    The index makes listings cheap (tansu lists a partition's batches on every fetch). It is
    rebuilt from the folder at start; only this process writes the folder. Every method that
    touches the disk is blocking and runs on a worker thread; the index is read and changed on
    the event loop only.
    """

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.folder = root / name
        self.temporary = root / TEMPORARY
        self.folder.mkdir(parents=True, exist_ok=True)
        self.temporary.mkdir(parents=True, exist_ok=True)
        self._keys: list[str] = []
        self._info: dict[str, ObjectInfo] = {}
        self._fragments: dict[str, tuple[ObjectInfo, bytes]] = {}
        self._locks = [asyncio.Lock() for _ in range(LOCK_STRIPES)]
        self.in_flight = WritesInFlight()
        for leftover in self.temporary.iterdir():  # a write cut short by a crash, never acknowledged
            leftover.unlink(missing_ok=True)
        for directory, _, files in os.walk(self.folder):
            for filename in files:
                path = Path(directory) / filename
                stat = path.stat()
                key = path.relative_to(self.folder).as_posix()
                self._info[key] = ObjectInfo(stat.st_size, stat.st_mtime, None)
        self._keys = sorted(self._info)

    def __len__(self) -> int:
        return len(self._keys)

    def lock(self, key: str) -> asyncio.Lock:
        """The lock that serialises check-and-write for ``key`` (striped: a few keys share one)."""
        return self._locks[hash(key) % LOCK_STRIPES]

    def info(self, key: str) -> ObjectInfo | None:
        return self._info.get(key)

    def remember(self, key: str, info: ObjectInfo | None) -> None:
        """Record a write (``info``) or a delete (None) in the index."""
        self._fragments.pop(key, None)
        if info is None:
            if self._info.pop(key, None) is not None:
                del self._keys[bisect.bisect_left(self._keys, key)]
            return
        if key not in self._info:
            bisect.insort(self._keys, key)
        self._info[key] = info

    def contents_xml(self, key: str, info: ObjectInfo) -> bytes:
        """The ``<Contents>`` element of ``key`` in a listing, kept until the object changes."""
        cached = self._fragments.get(key)
        if cached is not None and cached[0] is info:
            return cached[1]
        fragment = (f"<Contents><Key>{escape(key)}</Key><LastModified>{iso_date(info.modified)}</LastModified>"
                    + (f"<ETag>{escape(info.etag)}</ETag>" if info.etag is not None else "")
                    + f"<Size>{info.size}</Size><StorageClass>STANDARD</StorageClass></Contents>").encode()
        self._fragments[key] = (info, fragment)
        return fragment

    def path(self, key: str) -> Path:
        """The file of ``key``; refuses keys that cannot be one file (empty, ``.`` or ``..`` segments)."""
        parts = key.split("/")
        if not key or any(part in ("", ".", "..") for part in parts) or "\x00" in key:
            raise S3Error(400, "InvalidArgument", "this store refuses keys with empty, '.' or '..' segments", key)
        return self.folder.joinpath(*parts)

    # --- blocking disk work (worker threads) ---------------------------------------------------

    def write(self, key: str, body: bytes) -> ObjectInfo:
        """Store ``body`` under ``key`` durably and atomically; returns its new info."""
        info = self._place(key, lambda file: file.write(body))
        return ObjectInfo(info.size, info.modified, quote_etag(hashlib.md5(body).hexdigest()))

    def assemble(self, key: str, parts: list[Path], etag: str) -> ObjectInfo:
        """Store the concatenation of ``parts`` under ``key`` durably and atomically (a completed multipart upload)."""

        def copy(file: Any) -> None:
            for part in parts:
                with open(part, "rb") as source:
                    shutil.copyfileobj(source, file, 1 << 20)

        info = self._place(key, copy)
        return ObjectInfo(info.size, info.modified, etag)

    def _place(self, key: str, fill: Callable[[Any], object]) -> ObjectInfo:
        """Write a temporary file with ``fill``, fsync it and rename it to ``key``'s file (ETag left to the caller)."""
        target = self.path(key)
        temporary = self.temporary / uuid.uuid4().hex
        try:
            with open(temporary, "wb") as file:
                fill(file)
                file.flush()
                os.fsync(file.fileno())
            _make_folders(target.parent, self.folder)
            os.replace(temporary, target)
        except (IsADirectoryError, NotADirectoryError, FileExistsError):
            temporary.unlink(missing_ok=True)
            raise S3Error(409, "InvalidArgument", "a key and the same key followed by '/...' cannot both be objects "
                          "in this store", key) from None
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)
        stat = target.stat()
        return ObjectInfo(stat.st_size, stat.st_mtime, None)

    def read(self, key: str, known: ObjectInfo | None = None) -> tuple[bytes, ObjectInfo]:
        """The content of ``key`` and its info: ``known`` (what this store wrote or hashed last, read under the key's
        lock) where the file still has its size, else with the ETag computed from what was read (after a restart)."""
        path = self.path(key)
        try:
            body = path.read_bytes()
            if known is not None and known.etag is not None and known.size == len(body):
                return body, known  # hashing every read cost ~1.4 us of the ~16 us a span costs this store
            modified = path.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise S3Error(404, "NoSuchKey", "The specified key does not exist.", key) from None
        return body, ObjectInfo(len(body), modified, quote_etag(hashlib.md5(body).hexdigest()))

    def remove(self, key: str) -> None:
        """Delete ``key`` durably; deleting a missing key is not an error (as in S3)."""
        path = self.path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        _fsync_directory(path.parent)

    # --- listing (event loop) ------------------------------------------------------------------

    def list(self, prefix: str, delimiter: str, after: str, max_keys: int
             ) -> tuple[list[tuple[str, ObjectInfo]], list[str], str | None]:
        """ListObjectsV2 over the index: (objects, common prefixes, the marker to resume after if truncated)."""
        keys = self._keys
        start = bisect.bisect_right(keys, after) if after > prefix else bisect.bisect_left(keys, prefix)
        if delimiter and after.endswith(delimiter) and after.startswith(prefix) and after != prefix:
            start = max(start, bisect.bisect_left(keys, after + "\U0010ffff"))  # resume past a common prefix
        objects: list[tuple[str, ObjectInfo]] = []
        prefixes: list[str] = []
        last = after
        index = start
        while index < len(keys) and keys[index].startswith(prefix):
            if len(objects) + len(prefixes) >= max_keys:
                return objects, prefixes, last if max_keys else None
            key = keys[index]
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                last = key[: cut + len(delimiter)]
                prefixes.append(last)
                index = bisect.bisect_left(keys, last + "\U0010ffff", index)
                continue
            objects.append((key, self._info[key]))
            last = key
            index += 1
        return objects, prefixes, None



def _make_folders(folder: Path, top: Path) -> None:
    """Create ``folder`` and its missing parents below ``top``, each new entry fsynced into its parent."""
    missing = []
    while not folder.is_dir() and folder != top:
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:
            if not new.is_dir():
                raise
            continue
        _fsync_directory(new.parent)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def iso_date(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
