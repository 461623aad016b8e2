"""OTLP/HTTP in front of :class:`agentstream.pipeline.collector.receiver.OtlpReceiver`: ``POST /v1/traces``, ``/v1/logs``,
``/v1/metrics``.

Bodies are protobuf (``application/x-protobuf``) or JSON, with any ``Content-Encoding`` aiohttp
inflates before a handler reads the body (gzip, deflate, zstd; br with Brotli installed), its size
limit applying to the inflated body. Errors answer in the request's encoding: 400 (does not decode,
or claims an encoding it is not in), 401 (no collector key), 413 (too large), 415 (another media
type or encoding), 503 with ``Retry-After`` (back-pressure). ``GET /health`` serves the counters.
"""

from __future__ import annotations

from functools import partial

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from google.protobuf import json_format
from google.protobuf.message import Message

from agentstream.pipeline.collector.receiver import (
    INVALID_ARGUMENT,
    JSON,
    PROTOBUF,
    SIGNALS,
    UNAUTHENTICATED,
    UNAVAILABLE,
    Busy,
    KafkaDeadLetters,
    OtlpReceiver,
    Refused,
    Signal,
    decode_request,
    status_protobuf,
)

INFLATED = frozenset({"gzip", "deflate", "br", "zstd"})
"""Content-Encodings aiohttp's parser inflates (or refuses with its own 400) before the handler reads the body."""


def _media(request: web.Request) -> str:
    media = request.content_type.lower()
    if media == PROTOBUF or media == "application/protobuf":
        return PROTOBUF
    if media == JSON:
        return JSON
    raise Refused(415, f"Content-Type must be {PROTOBUF} or {JSON}, got {request.content_type!r}")


def _error(status: int, code: int, message: str, encoding: str, headers: dict[str, str] | None = None
           ) -> web.Response:
    """An OTLP error response: a google.rpc.Status in the request's encoding."""
    if encoding == PROTOBUF:
        return web.Response(status=status, body=status_protobuf(code, message), content_type=PROTOBUF,
                            headers=headers)
    return web.json_response({"code": code, "message": message}, status=status, headers=headers)


def _answer(response: Message, encoding: str) -> web.Response:
    if encoding == PROTOBUF:
        return web.Response(status=200, body=response.SerializeToString(), content_type=PROTOBUF)
    return web.json_response(json_format.MessageToDict(response))


class OtlpHttp:
    """The aiohttp application over one receiver; serve ``.app``."""

    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver
        self.app = web.Application(client_max_size=receiver.max_body_bytes)
        for signal in SIGNALS:
            self.app.router.add_post(signal.path, partial(self.export, signal))
        self.app.router.add_get("/health", self.health)
        if isinstance(receiver.dead_letters, KafkaDeadLetters):  # its producer lives on the loop serving the app
            self.app.on_startup.append(self._start_dead_letters)
            self.app.on_cleanup.append(self._stop_dead_letters)

    async def _start_dead_letters(self, app: web.Application) -> None:
        assert isinstance(self.receiver.dead_letters, KafkaDeadLetters)
        await self.receiver.dead_letters.start()

    async def _stop_dead_letters(self, app: web.Application) -> None:
        assert isinstance(self.receiver.dead_letters, KafkaDeadLetters)
        await self.receiver.dead_letters.stop()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.receiver.stats.__dict__})

    async def export(self, signal: Signal, request: web.Request) -> web.Response:
        receiver = self.receiver
        receiver.stats.requests += 1
        encoding = PROTOBUF if request.content_type.lower() in (PROTOBUF, "application/protobuf") else JSON
        if not receiver.authorized(request.headers):
            return _error(401, UNAUTHENTICATED, "this collector takes exports with one of its keys only: send "
                          "'Authorization: Bearer <key>' (OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<key>)",
                          encoding, {"WWW-Authenticate": "Bearer"})
        body = b""
        try:
            body = await self._read(request)  # before the media check, so a refused body is kept as its dead letter
            decoded = decode_request(body, _media(request), signal.request)
        except Refused as refused:
            await receiver.refuse(signal, refused, body, request.remote)
            return _error(refused.status, INVALID_ARGUMENT, str(refused), encoding)
        try:
            return _answer(await receiver.export(signal, decoded), encoding)
        except Busy as busy:
            return _error(503, UNAVAILABLE, str(busy), encoding, {"Retry-After": str(busy.retry_after_s)})

    async def _read(self, request: web.Request) -> bytes:
        """The body, inflated by aiohttp; Refused for an encoding it does not inflate, or a body that does not."""
        content_encoding = request.headers.get("Content-Encoding", "").strip().lower()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as error:
            raise Refused(413, f"the body is larger than {self.receiver.max_body_bytes} bytes (once inflated)") \
                from error
        except RequestPayloadError:
            raise Refused(400, f"the body is not valid {content_encoding}, as its Content-Encoding says") from None
        if content_encoding not in ("", "identity") and content_encoding not in INFLATED:
            raise Refused(415, f"Content-Encoding {content_encoding!r} is not supported "
                               f"(gzip, deflate, zstd or none)")
        return body


async def serve_http(receiver: OtlpReceiver, host: str, port: int) -> web.AppRunner:
    """Serve OTLP/HTTP on host:port from the running loop; the caller cleans the runner up."""
    runner = web.AppRunner(OtlpHttp(receiver).app, access_log=None)  # aiohttp's default auto_decompress inflates
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


__all__ = ["OtlpHttp", "serve_http"]
