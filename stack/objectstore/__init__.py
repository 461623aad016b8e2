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

from typing import TYPE_CHECKING, Any

from agentstream.stack.objectstore.address import HOST
from agentstream.stack.objectstore.bucket import S3Error

if TYPE_CHECKING:
    from agentstream.stack.objectstore.server import ObjectStoreServer, main, serve, walk_keys

_SERVER_NAMES = ("ObjectStoreServer", "main", "serve", "walk_keys")

__all__ = ["HOST", "ObjectStoreServer", "S3Error", "main", "serve", "walk_keys"]


def __getattr__(name: str) -> Any:
    """The server's names, imported when first used: every command needs HOST, few need aiohttp (0.3 s)."""
    if name in _SERVER_NAMES:
        from agentstream.stack.objectstore import server
        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
