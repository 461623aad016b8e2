"""A small S3-compatible object store over a local directory: the durable storage of the embedded broker.

tansu keeps every record batch, watermark, group offset and its metadata as objects through
an S3 client (Rust ``object_store``, conditional puts on ETags). This server answers the part
of the S3 REST API that client uses, path-style (``/<bucket>/<key>``):

- ``PUT`` an object, with ``If-None-Match: *`` (create only) or ``If-Match: <etag>`` (replace
  only that version), answered as S3 answers them: 412 ``PreconditionFailed`` when the
  condition fails, 404 ``NoSuchKey`` for ``If-Match`` on a missing key;
- ``GET``/``HEAD`` an object, with ``If-Match`` (412), ``If-None-Match`` (304) and ``Range``;
- ``DELETE`` an object, and ``POST /<bucket>?delete`` (DeleteObjects);
- ``GET /<bucket>?list-type=2`` (ListObjectsV2: prefix, delimiter, start-after,
  continuation-token, max-keys), ``HEAD /<bucket>``;
- multipart uploads (create, upload part, complete, abort), which checkpoint stores use for
  large files: parts wait in ``<root>/.uploads`` and the object appears whole, as a PUT's does,
  when the upload completes; uploads not completed before a restart are dropped.

Anything else (listing uploads or parts, copies, versioning, ACLs) is answered 501 ``NotImplemented``.
The stack's store does not authenticate requests, so it always listens on 127.0.0.1
(:data:`HOST`), whatever the stack's host: only the local broker and the checkpoint stores of
this machine talk to it. Given ``credentials`` (key id -> secret), it checks each request's AWS
Signature Version 4 header as S3 does (403 ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``).

Durability: a PUT is answered only after the object's bytes and its directory entry are on
disk (temporary file, ``fsync``, ``rename``, ``fsync`` of the directory), so an object the
broker was told is stored survives a SIGKILL of either process and a power cut. Each object is
one plain file at ``<root>/<bucket>/<key>``; temporary files live in ``<root>/.tmp``. ETags are
the MD5 of the content, as S3's for single-part uploads. A key that would need a file and a
folder of the same name (``a`` and ``a/b``) is refused; tansu never writes such pairs.

Run it with ``python -m agentstream.stack.objectstore --port 9000 --root PATH --bucket tansu``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import email.utils
import hashlib
import hmac
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from aiohttp import web

from agentstream.schemas.errors import AgentstreamError
from agentstream.stack.signals import stop_on_signals

log = logging.getLogger("agentstream.objectstore")
T = TypeVar("T")

S3_NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
XML_DECLARATION = b'<?xml version="1.0" encoding="UTF-8"?>\n'
MAX_OBJECT_BYTES = 1 << 30  # a record batch is a few MB at most; S3's own single-PUT limit is 5 GiB
MAX_KEYS = 1000
LOCK_STRIPES = 64
TEMPORARY = ".tmp"
UPLOADS = ".uploads"
MAX_PARTS = 10_000
HOST = "127.0.0.1"


class S3Error(AgentstreamError):
    """A request the store refuses, with the S3 error code and HTTP status a client expects."""

    def __init__(self, status: int, code: str, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.key = key


def _precondition_failed(key: str) -> S3Error:
    return S3Error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold", key)


class _NotModified(Exception):
    """A conditional GET whose ``If-None-Match`` matches: answered 304 with no body.

    Control flow inside this module (``handle`` catches it), not an error, so not an ``AgentstreamError``."""

    def __init__(self, etag: str) -> None:
        super().__init__(etag)
        self.etag = etag


@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one object without reading it."""

    size: int
    modified: float  # seconds since the epoch
    etag: str | None  # quoted MD5 hex; None until the content has been read once after a restart


def _quote_etag(digest: str) -> str:
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
        fragment = (f"<Contents><Key>{escape(key)}</Key><LastModified>{_iso_date(info.modified)}</LastModified>"
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
        return ObjectInfo(info.size, info.modified, _quote_etag(hashlib.md5(body).hexdigest()))

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
        return body, ObjectInfo(len(body), modified, _quote_etag(hashlib.md5(body).hexdigest()))

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


def _http_date(timestamp: float) -> str:
    return email.utils.formatdate(timestamp, usegmt=True)


def _iso_date(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _xml(root: ElementTree.Element) -> bytes:
    return XML_DECLARATION + ElementTree.tostring(root, encoding="utf-8",
                                                                              xml_declaration=False)


def _element(parent: ElementTree.Element, tag: str, text: str | int | None = None) -> ElementTree.Element:
    child = ElementTree.SubElement(parent, tag)
    if text is not None:
        child.text = str(text)
    return child


def _byte_range(header: str, size: int) -> tuple[int, int]:
    """The inclusive (first, last) byte of a ``Range: bytes=...`` header; S3 answers 416 when unsatisfiable."""
    unit, _, spec = header.partition("=")
    first_text, _, last_text = spec.strip().partition("-")
    if unit.strip() != "bytes" or "," in spec:
        raise S3Error(501, "NotImplemented", "only a single byte range is supported")
    try:
        if first_text == "":
            first, last = max(0, size - int(last_text)), size - 1
        else:
            first = int(first_text)
            last = min(int(last_text), size - 1) if last_text else size - 1
    except ValueError:
        raise S3Error(400, "InvalidArgument", f"bad Range header {header!r}") from None
    if first >= size or first > last:
        raise S3Error(416, "InvalidRange", "The requested range is not satisfiable")
    return first, last


class ObjectStoreServer:
    """The aiohttp application: S3 requests routed to the buckets under one root folder."""

    def __init__(self, root: Path, buckets: list[str], log_requests: bool = False,
                 credentials: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.credentials = dict(credentials) if credentials else None
        self.buckets = {name: Bucket(root, name) for name in buckets}
        self.uploads = root / UPLOADS
        shutil.rmtree(self.uploads, ignore_errors=True)  # uploads a restart cut short were never completed
        self._uploads: dict[str, tuple[str, str, dict[int, tuple[str, Path]]]] = {}  # id -> bucket, key, parts
        self.log_requests = log_requests
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="objectstore")
        self.app = web.Application(client_max_size=MAX_OBJECT_BYTES)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    async def _run(self, function: Callable[..., T], *args: object) -> T:
        """Run blocking disk work on the store's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        bucket_name, _, key = request.rel_url.raw_path.lstrip("/").partition("/")
        bucket_name, key = unquote(bucket_name), unquote(key)
        try:
            if self.credentials is not None:
                await self._authenticate(request)
            response = await self._dispatch(request, bucket_name, key)
        except _NotModified as answer:
            response = web.Response(status=304, headers={"ETag": answer.etag})
        except S3Error as error:
            response = self._error(error, request.rel_url.raw_path)
        if self.log_requests:
            conditions = {name: request.headers[name] for name in ("If-Match", "If-None-Match", "Range")
                          if name in request.headers}
            log.info("%s %s %s -> %d (%.1f ms) %s", request.method, request.rel_url.raw_path,
                     request.rel_url.raw_query_string, response.status, (time.perf_counter() - started) * 1e3,
                     conditions or "")
        return response

    async def _authenticate(self, request: web.Request) -> None:
        """Check the request's AWS Signature Version 4 (header form, as boto3 and the AWS SDKs send it)."""
        assert self.credentials is not None
        scheme, _, fields_text = request.headers.get("Authorization", "").partition(" ")
        if scheme != "AWS4-HMAC-SHA256":
            raise S3Error(403, "AccessDenied", "this store takes only requests signed with AWS Signature Version 4")
        try:
            fields = dict(part.strip().split("=", 1) for part in fields_text.split(","))
            key_id, date, region, service, _ = fields["Credential"].split("/")
            signed, signature = fields["SignedHeaders"], fields["Signature"]
        except (KeyError, ValueError):
            raise S3Error(400, "AuthorizationHeaderMalformed", "the Authorization header is malformed") from None
        secret = self.credentials.get(key_id)
        if secret is None:
            raise S3Error(403, "InvalidAccessKeyId",
                          "The AWS Access Key Id you provided does not exist in our records.")
        payload = request.headers.get("x-amz-content-sha256", "")
        if len(payload) == 64 and request.method in ("PUT", "POST"):
            if hashlib.sha256(await request.read()).hexdigest() != payload:
                raise S3Error(400, "XAmzContentSHA256Mismatch", "the body does not match x-amz-content-sha256")
        elif payload != "UNSIGNED-PAYLOAD" and len(payload) != 64:
            raise S3Error(501, "NotImplemented", "only signed or UNSIGNED-PAYLOAD bodies are supported")
        pairs = sorted((quote(unquote(name), safe="-_.~"), quote(unquote(value), safe="-_.~"))
                       for name, _, value in (pair.partition("=") for pair in
                                              request.rel_url.raw_query_string.split("&") if pair))
        headers = "".join(f"{name}:{' '.join(request.headers.get(name, '').split())}\n" for name in signed.split(";"))
        canonical = "\n".join([request.method, request.rel_url.raw_path, "&".join(f"{n}={v}" for n, v in pairs),
                               headers, signed, payload])
        scope = f"{date}/{region}/{service}/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", request.headers.get("x-amz-date", ""), scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        key = f"AWS4{secret}".encode()
        for part in (date, region, service, "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest(), signature):
            raise S3Error(403, "SignatureDoesNotMatch", "The request signature we calculated does not match the "
                          "signature you provided. Check your key and signing method.")

    def _error(self, error: S3Error, resource: str) -> web.Response:
        root = ElementTree.Element("Error")
        _element(root, "Code", error.code)
        _element(root, "Message", str(error))
        if error.key is not None:
            _element(root, "Key", error.key)
        _element(root, "Resource", resource)
        _element(root, "RequestId", uuid.uuid4().hex)
        return web.Response(status=error.status, body=_xml(root), content_type="application/xml")

    async def _dispatch(self, request: web.Request, bucket_name: str, key: str) -> web.StreamResponse:
        bucket = self.buckets.get(bucket_name)
        if bucket is None:
            raise S3Error(404, "NoSuchBucket", "The specified bucket does not exist")
        query = request.rel_url.query
        method = request.method
        if key and "uploadId" in query:
            return await self._multipart(request, bucket, key, query["uploadId"])
        if key and method == "POST" and "uploads" in query:
            return self._create_upload(bucket, key)
        unsupported = {"uploads", "uploadId", "partNumber", "versionId", "acl", "tagging", "versioning"} & set(query)
        if unsupported or "x-amz-copy-source" in request.headers:
            raise S3Error(501, "NotImplemented", f"this store does not implement {sorted(unsupported) or 'copies'}")
        if not key:
            if method == "GET":
                return await self._list(bucket, query)
            if method == "HEAD":
                return web.Response(status=200)
            if method == "POST" and "delete" in query:
                return await self._delete_many(bucket, await request.read())
            raise S3Error(501, "NotImplemented", f"{method} on a bucket is not implemented")
        if method == "PUT":
            return await self._put(bucket, key, request)
        if method in ("GET", "HEAD"):
            return await self._get(bucket, key, request)
        if method == "DELETE":
            async with bucket.lock(key):
                await self._run(bucket.remove, key)
                bucket.remember(key, None)
            return web.Response(status=204)
        raise S3Error(405, "MethodNotAllowed", f"{method} is not allowed on an object")

    def _create_upload(self, bucket: Bucket, key: str) -> web.Response:
        bucket.path(key)  # refuse a bad key now, not at the end
        upload_id = uuid.uuid4().hex
        (self.uploads / upload_id).mkdir(parents=True)
        self._uploads[upload_id] = (bucket.name, key, {})
        root = ElementTree.Element("InitiateMultipartUploadResult", xmlns=S3_NAMESPACE)
        _element(root, "Bucket", bucket.name)
        _element(root, "Key", key)
        _element(root, "UploadId", upload_id)
        return web.Response(body=_xml(root), content_type="application/xml")

    async def _multipart(self, request: web.Request, bucket: Bucket, key: str, upload_id: str) -> web.Response:
        """Upload a part (PUT), complete (POST) or abort (DELETE) the multipart upload ``upload_id`` of ``key``."""
        upload = self._uploads.get(upload_id)
        if upload is None or upload[:2] != (bucket.name, key):
            raise S3Error(404, "NoSuchUpload", "The specified multipart upload does not exist.", key)
        parts = upload[2]
        folder = self.uploads / upload_id
        if request.method == "PUT":
            try:
                number = int(request.rel_url.query.get("partNumber", ""))
            except ValueError:
                number = 0
            if not 1 <= number <= MAX_PARTS:
                raise S3Error(400, "InvalidArgument", f"partNumber must be an integer from 1 to {MAX_PARTS}")
            body = await request.read()
            path = folder / f"{number:05d}"
            await self._run(path.write_bytes, body)
            parts[number] = (hashlib.md5(body).hexdigest(), path)
            return web.Response(status=200, headers={"ETag": _quote_etag(parts[number][0])})
        if request.method == "DELETE":
            del self._uploads[upload_id]
            await self._run(shutil.rmtree, folder, True)
            return web.Response(status=204)
        if request.method != "POST":
            raise S3Error(405, "MethodNotAllowed", f"{request.method} is not allowed on a multipart upload")
        try:
            listed = [(int(_child_text(entry, "PartNumber")), _child_text(entry, "ETag").strip('"'))
                      for entry in ElementTree.fromstring(await request.read()) if _local(entry.tag) == "Part"]
        except (ElementTree.ParseError, ValueError):
            raise S3Error(400, "MalformedXML", "The XML you provided was not well-formed") from None
        numbers = [number for number, _ in listed]
        if not listed or numbers != sorted(set(numbers)):
            raise S3Error(400, "InvalidPartOrder", "The list of parts was not in ascending order.", key)
        if any(number not in parts or parts[number][0] != etag for number, etag in listed):
            raise S3Error(400, "InvalidPart", "One or more of the specified parts could not be found.", key)
        digests = b"".join(bytes.fromhex(parts[number][0]) for number in numbers)
        etag = _quote_etag(f"{hashlib.md5(digests).hexdigest()}-{len(numbers)}")  # as S3 tags multipart objects
        arrived = bucket.in_flight.begin(key)
        try:
            async with bucket.lock(key):
                info = await self._run(bucket.assemble, key, [parts[number][1] for number in numbers], etag)
                bucket.remember(key, info)
        finally:
            bucket.in_flight.end(arrived)
        del self._uploads[upload_id]
        await self._run(shutil.rmtree, folder, True)
        root = ElementTree.Element("CompleteMultipartUploadResult", xmlns=S3_NAMESPACE)
        _element(root, "Bucket", bucket.name)
        _element(root, "Key", key)
        _element(root, "ETag", etag)
        return web.Response(body=_xml(root), content_type="application/xml")

    async def _current(self, bucket: Bucket, key: str) -> ObjectInfo | None:
        """The info of ``key`` with its ETag known (reads the object once after a restart)."""
        info = bucket.info(key)
        if info is not None and info.etag is None:
            _, info = await self._run(bucket.read, key)
            bucket.remember(key, info)
        return info

    async def _put(self, bucket: Bucket, key: str, request: web.Request) -> web.Response:
        arrived = bucket.in_flight.begin(key)
        try:
            return await self._store(bucket, key, request)
        finally:
            bucket.in_flight.end(arrived)

    async def _store(self, bucket: Bucket, key: str, request: web.Request) -> web.Response:
        body = await request.read()
        if_none_match = request.headers.get("If-None-Match")
        if_match = request.headers.get("If-Match")
        if if_none_match is not None and if_none_match.strip() != "*":
            raise S3Error(501, "NotImplemented", "If-None-Match on PUT supports only '*'")
        async with bucket.lock(key):
            bucket.path(key)  # refuse a bad key before any condition is checked
            current = await self._current(bucket, key) if (if_match or if_none_match) else None
            if if_none_match is not None and current is not None:
                raise _precondition_failed(key)
            if if_match is not None:
                if current is None:
                    raise S3Error(404, "NoSuchKey", "The specified key does not exist.", key)
                if not _etag_matches(if_match, current.etag or ""):
                    raise _precondition_failed(key)
            info = await self._run(bucket.write, key, body)
            bucket.remember(key, info)
        assert info.etag is not None
        return web.Response(status=200, headers={"ETag": info.etag})

    async def _get(self, bucket: Bucket, key: str, request: web.Request) -> web.Response:
        async with bucket.lock(key):  # a read racing a write would put a stale ETag in the index
            known = bucket.info(key)
            if known is None:
                bucket.path(key)
                raise S3Error(404, "NoSuchKey", "The specified key does not exist.", key)
            body, info = await self._run(bucket.read, key, known)
            bucket.remember(key, info)
        assert info.etag is not None
        if_match = request.headers.get("If-Match")
        if if_match is not None and not _etag_matches(if_match, info.etag):
            raise _precondition_failed(key)
        if_none_match = request.headers.get("If-None-Match")
        if if_none_match is not None and _etag_matches(if_none_match, info.etag):
            raise _NotModified(info.etag)
        headers = {"ETag": info.etag, "Last-Modified": _http_date(info.modified), "Accept-Ranges": "bytes"}
        status = 200
        if "Range" in request.headers:
            first, last = _byte_range(request.headers["Range"], info.size)
            body = body[first : last + 1]
            headers["Content-Range"] = f"bytes {first}-{last}/{info.size}"
            status = 206
        return web.Response(status=status, body=body, headers=headers, content_type="application/octet-stream")

    async def _list(self, bucket: Bucket, query: Mapping[str, str]) -> web.Response:
        if query.get("list-type") != "2":
            raise S3Error(501, "NotImplemented", "only ListObjectsV2 (list-type=2) is implemented")
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        start_after = query.get("start-after", "")
        token = query.get("continuation-token")
        try:
            max_keys = max(0, min(MAX_KEYS, int(query.get("max-keys", MAX_KEYS))))
            after = base64.urlsafe_b64decode(token.encode()).decode() if token else start_after
        except ValueError:
            raise S3Error(400, "InvalidArgument", "bad max-keys or continuation-token") from None
        await bucket.in_flight.settle(prefix)
        objects, prefixes, resume = bucket.list(prefix, delimiter, after, max_keys)
        head = [f'<ListBucketResult xmlns="{S3_NAMESPACE}"><Name>{escape(bucket.name)}</Name>',
                f"<Prefix>{escape(prefix)}</Prefix>",
                f"<Delimiter>{escape(delimiter)}</Delimiter>" if delimiter else "",
                f"<MaxKeys>{max_keys}</MaxKeys><KeyCount>{len(objects) + len(prefixes)}</KeyCount>",
                f"<IsTruncated>{'true' if resume is not None else 'false'}</IsTruncated>",
                f"<ContinuationToken>{escape(token)}</ContinuationToken>" if token else "",
                "" if resume is None else
                f"<NextContinuationToken>{base64.urlsafe_b64encode(resume.encode()).decode()}</NextContinuationToken>",
                f"<StartAfter>{escape(start_after)}</StartAfter>" if start_after else ""]
        body = [XML_DECLARATION, "".join(head).encode()]
        body += [bucket.contents_xml(key, info) for key, info in objects]  # cached: tansu lists on every fetch
        body += [f"<CommonPrefixes><Prefix>{escape(common)}</Prefix></CommonPrefixes>".encode() for common in prefixes]
        body.append(b"</ListBucketResult>")
        return web.Response(body=b"".join(body), content_type="application/xml")

    async def _delete_many(self, bucket: Bucket, body: bytes) -> web.Response:
        try:
            document = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            raise S3Error(400, "MalformedXML", "The XML you provided was not well-formed") from None
        quiet = any(_local(e.tag) == "Quiet" and (e.text or "").strip() == "true" for e in document)
        keys = [(child.text or "") for entry in document if _local(entry.tag) == "Object"
                for child in entry if _local(child.tag) == "Key"]
        root = ElementTree.Element("DeleteResult", xmlns=S3_NAMESPACE)
        for key in keys:
            try:
                async with bucket.lock(key):
                    await self._run(bucket.remove, key)
                    bucket.remember(key, None)
            except S3Error as error:
                failed = _element(root, "Error")
                _element(failed, "Key", key)
                _element(failed, "Code", error.code)
                _element(failed, "Message", str(error))
                continue
            if not quiet:
                _element(_element(root, "Deleted"), "Key", key)
        return web.Response(body=_xml(root), content_type="application/xml")


def _local(tag: str) -> str:
    """An XML tag without its ``{namespace}``."""
    return tag.rpartition("}")[2]


def _child_text(element: ElementTree.Element, tag: str) -> str:
    """The text of ``element``'s first child named ``tag`` (any namespace); ValueError if there is none."""
    for child in element:
        if _local(child.tag) == tag:
            return (child.text or "").strip()
    raise ValueError(f"no <{tag}>")


def walk_keys(root: Path, bucket: str) -> Iterator[str]:
    """The keys stored for ``bucket`` under ``root`` (for tools and tests that inspect the folder)."""
    folder = root / bucket
    for directory, _, files in os.walk(folder):
        for filename in files:
            yield (Path(directory) / filename).relative_to(folder).as_posix()


async def serve(port: int, root: Path, buckets: list[str], log_requests: bool = False) -> None:
    """Serve on loopback until SIGTERM or SIGINT. Nothing is buffered: every answered write is already on disk."""
    server = ObjectStoreServer(root, buckets, log_requests)
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, port, reuse_address=True)
    await site.start()
    log.info("S3 object store on http://%s:%d, buckets %s (%s objects) in %s", HOST, port, ", ".join(buckets),
             ", ".join(str(len(bucket)) for bucket in server.buckets.values()), root)
    await stop_on_signals().wait()
    await runner.cleanup()
    server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a folder as a small S3-compatible object store on 127.0.0.1.")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--root", type=Path, required=True, help="the folder that holds the buckets")
    parser.add_argument("--bucket", action="append", required=True, help="a bucket to serve (repeatable)")
    parser.add_argument("--log-requests", action="store_true", help="log every request (method, path, status)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvloop

    uvloop.run(serve(args.port, args.root.resolve(), args.bucket, args.log_requests))


if __name__ == "__main__":
    main()
