"""The S3 REST API over the buckets (:mod:`.bucket`): requests, conditions, listings, multipart uploads, SigV4."""

from __future__ import annotations

import argparse
import asyncio
import base64
import email.utils
import errno
import hashlib
import hmac
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from aiohttp import web

from agentstream.stack.objectstore.address import HOST
from agentstream.stack.objectstore.bucket import Bucket, ObjectInfo, S3Error, quote_etag
from agentstream.stack.signals import stop_on_signals

log = logging.getLogger("agentstream.objectstore")
T = TypeVar("T")

S3_NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
XML_DECLARATION = b'<?xml version="1.0" encoding="UTF-8"?>\n'
DISK_REFUSALS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})  # the disk's trouble: retried, not refused
DECLARED_SHA256 = "agentstream.declared_sha256"  # where _authenticate leaves a signed body's hash for its reader
RECEIVE_CHUNK_BYTES = 1 << 20
MAX_OBJECT_BYTES = 1 << 30  # a record batch is a few MB at most; S3's own single-PUT limit is 5 GiB
MAX_KEYS = 1000
UPLOADS = ".uploads"
MAX_PARTS = 10_000


async def _body(request: web.Request) -> bytes:
    """The whole body (bounded by the app's client_max_size), checked against a signed x-amz-content-sha256."""
    body = await request.read()
    declared = request.get(DECLARED_SHA256)
    if declared is not None and hashlib.sha256(body).hexdigest() != declared:
        raise S3Error(400, "XAmzContentSHA256Mismatch", "the body does not match x-amz-content-sha256")
    return body


def _absorb(file: Any, chunk: bytes, *hashes: Any) -> None:
    file.write(chunk)
    for digest in hashes:
        digest.update(chunk)


def _precondition_failed(key: str) -> S3Error:
    return S3Error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold", key)


class _NotModified(Exception):
    """A conditional GET whose ``If-None-Match`` matches: answered 304 with no body.

    Control flow inside this module (``handle`` catches it), not an error, so not an ``AgentstreamError``."""

    def __init__(self, etag: str) -> None:
        super().__init__(etag)
        self.etag = etag


def _etag_matches(header: str, etag: str) -> bool:
    """Whether an ``If-Match``/``If-None-Match`` header (a list of tags or ``*``) names ``etag``."""
    wanted = {tag.strip().removeprefix("W/") for tag in header.split(",")}
    return "*" in wanted or etag in wanted or etag.strip('"') in wanted


def _http_date(timestamp: float) -> str:
    return email.utils.formatdate(timestamp, usegmt=True)



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
        self._refused_since: float | None = None  # when the disk began refusing writes (full, read-only)
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
        except OSError as error:
            if error.errno not in DISK_REFUSALS:
                raise
            response = self._error(self._disk_refused(error), request.rel_url.raw_path)
        else:
            if self._refused_since is not None and request.method in ("PUT", "POST"):
                log.warning("the store's disk takes writes again after %.1f s", time.monotonic() - self._refused_since)
                self._refused_since = None
        if self.log_requests:
            conditions = {name: request.headers[name] for name in ("If-Match", "If-None-Match", "Range")
                          if name in request.headers}
            log.info("%s %s %s -> %d (%.1f ms) %s", request.method, request.rel_url.raw_path,
                     request.rel_url.raw_query_string, response.status, (time.perf_counter() - started) * 1e3,
                     conditions or "")
        return response

    def _disk_refused(self, error: OSError) -> S3Error:
        """A full or read-only disk is the store's trouble, not the request's: 503, which S3 clients retry."""
        if self._refused_since is None:
            self._refused_since = time.monotonic()
            log.warning("the store's disk under %s refuses writes (%s): answering 503 until it takes them again",
                        self.root, error.strerror)
        return S3Error(503, "ServiceUnavailable", f"the store's disk refuses writes ({error.strerror}); retry later")

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
            request[DECLARED_SHA256] = payload  # checked against the body as it is read (_body, _receive)
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
                return await self._delete_many(bucket, await _body(request))
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
            path = folder / f"{number:05d}"
            parts[number] = (await self._receive(request, path), path)
            return web.Response(status=200, headers={"ETag": quote_etag(parts[number][0])})
        if request.method == "DELETE":
            del self._uploads[upload_id]
            await self._run(shutil.rmtree, folder, True)
            return web.Response(status=204)
        if request.method != "POST":
            raise S3Error(405, "MethodNotAllowed", f"{request.method} is not allowed on a multipart upload")
        try:
            listed = [(int(_child_text(entry, "PartNumber")), _child_text(entry, "ETag").strip('"'))
                      for entry in ElementTree.fromstring(await _body(request)) if _local(entry.tag) == "Part"]
        except (ElementTree.ParseError, ValueError):
            raise S3Error(400, "MalformedXML", "The XML you provided was not well-formed") from None
        numbers = [number for number, _ in listed]
        if not listed or numbers != sorted(set(numbers)):
            raise S3Error(400, "InvalidPartOrder", "The list of parts was not in ascending order.", key)
        if any(number not in parts or parts[number][0] != etag for number, etag in listed):
            raise S3Error(400, "InvalidPart", "One or more of the specified parts could not be found.", key)
        digests = b"".join(bytes.fromhex(parts[number][0]) for number in numbers)
        etag = quote_etag(f"{hashlib.md5(digests).hexdigest()}-{len(numbers)}")  # as S3 tags multipart objects
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

    async def _receive(self, request: web.Request, path: Path) -> str:
        """Write the body to ``path`` as it arrives (a part of up to a GiB is never whole in memory); its MD5 hex.

        The body's SHA-256 is checked against a signed request's x-amz-content-sha256 at the end: a
        mismatch removes the file and is refused.
        """
        md5, sha256, size = hashlib.md5(), hashlib.sha256(), 0
        try:
            with open(path, "wb") as file:
                async for chunk in request.content.iter_chunked(RECEIVE_CHUNK_BYTES):
                    size += len(chunk)
                    if size > MAX_OBJECT_BYTES:
                        raise S3Error(400, "EntityTooLarge", f"a part is at most {MAX_OBJECT_BYTES} bytes here")
                    await self._run(_absorb, file, chunk, md5, sha256)
            declared = request.get(DECLARED_SHA256)
            if declared is not None and sha256.hexdigest() != declared:
                raise S3Error(400, "XAmzContentSHA256Mismatch", "the body does not match x-amz-content-sha256")
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return md5.hexdigest()

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
        body = await _body(request)
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

