"""OTLP/gRPC in front of :class:`agentstream.pipeline.collector.receiver.OtlpReceiver`: TraceService, LogsService and
MetricsService ``Export``.

Served by grpc.aio on the caller's event loop, beside OTLP/HTTP on the same receiver. The services
are those of opentelemetry-proto's ``*_service.proto`` (names from its generated modules), but
registered with raw-bytes handlers rather than the generated ``add_*Servicer_to_server``: the
receiver decodes each request itself, so a request that does not decode becomes an
INVALID_ARGUMENT with the reason and a dead letter, as over HTTP, not gRPC's bare INTERNAL.
Compressed requests (``grpc-encoding: gzip``/``deflate``) are inflated by gRPC. Errors:
UNAUTHENTICATED (no collector key in the ``authorization`` metadata), INVALID_ARGUMENT,
RESOURCE_EXHAUSTED (larger than the size limit, from gRPC itself), and UNAVAILABLE with a
``google.rpc.RetryInfo`` in the trailing metadata under back-pressure (the SDK exporters wait that
long, then retry).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NoReturn

import grpc
from multidict import CIMultiDict

from agentstream.infra.processes import ServiceError
from agentstream.pipeline.collector.receiver import (
    PROTOBUF,
    SIGNALS,
    Busy,
    OtlpReceiver,
    Refused,
    Signal,
    decode_request,
    retry_info_protobuf,
)

RETRY_INFO_KEY = "google.rpc.retryinfo-bin"


class GrpcBindError(ServiceError):
    """The gRPC receiver could not listen on the address it was given."""


def _headers(context: grpc.aio.ServicerContext) -> CIMultiDict[str]:
    """The call's text metadata as headers (gRPC sends ``authorization``; KeySet reads ``Authorization``)."""
    return CIMultiDict((key, value) for key, value in context.invocation_metadata() or ()
                       if isinstance(value, str))


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                 trailing: tuple[tuple[str, str | bytes], ...] = ()) -> NoReturn:
    await context.abort(code, message, trailing_metadata=trailing)
    raise AssertionError("grpc.aio's abort always raises")


async def export(receiver: OtlpReceiver, signal: Signal, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """One ``Export`` call: the request's protobuf bytes in, the response's out, or an aborted call that says why."""
    receiver.stats.requests += 1
    if not receiver.authorized(_headers(context)):
        await _abort(context, grpc.StatusCode.UNAUTHENTICATED, "this collector takes exports with one of its keys "
                     "only: send the metadata 'authorization: Bearer <key>' "
                     "(OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<key>)")
    try:
        request = decode_request(body, PROTOBUF, signal.request)
    except Refused as refused:
        await receiver.refuse(signal, refused, body, context.peer())
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(refused))
    try:
        response = await receiver.export(signal, request)
    except Busy as busy:
        await _abort(context, grpc.StatusCode.UNAVAILABLE, str(busy),
                     ((RETRY_INFO_KEY, retry_info_protobuf(busy.retry_after_s)),))
    return response.SerializeToString()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass(frozen=True)
class GrpcServing:
    """A started OTLP/gRPC server and the port it listens on."""

    server: grpc.aio.Server
    port: int

    async def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new calls, let those in flight finish for up to `grace_s`, then close."""
        await self.server.stop(grace_s)


async def serve_grpc(receiver: OtlpReceiver, host: str, port: int) -> GrpcServing:
    """Serve OTLP/gRPC on host:port (0: a free port) from the running loop; the caller stops it."""
    # no SO_REUSEPORT (gRPC's default): a second collector on the same port must fail, not share its calls
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", receiver.max_body_bytes),
                                      ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(signal.service, {
            "Export": grpc.unary_unary_rpc_method_handler(partial(export, receiver, signal))})
        for signal in SIGNALS])
    try:
        bound = server.add_insecure_port(_address(host, port))
    except RuntimeError as error:
        raise GrpcBindError(f"the OTLP/gRPC receiver cannot listen on {_address(host, port)}: {error}") from None
    if not bound:
        raise GrpcBindError(f"the OTLP/gRPC receiver cannot listen on {_address(host, port)}")
    await server.start()
    return GrpcServing(server, bound)


__all__ = ["GrpcBindError", "GrpcServing", "export", "serve_grpc"]
