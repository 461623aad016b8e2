"""The [otlp] section: where the OTLP receiver listens and how a trace's rollout ends."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.checks import Checks


@dataclass(frozen=True)
class OtlpConfig:
    """The OTLP receiver (``agentstream collector``): where it listens and how traces end.

    ``port`` 4318 is OTLP/HTTP's registered port, so exporters find it with just
    ``OTEL_EXPORTER_OTLP_ENDPOINT=http://<host>:4318``; ``grpc_port`` 4317 is OTLP/gRPC's (0 turns
    the gRPC receiver off), on the same ``host``. With ``complete_on_root`` a trace that is its
    own rollout completes when its root span arrives (the root ends last); otherwise, and for
    rollouts named by an ``agentstream.rollout_id`` attribute, after ``streams.idle_timeout_s`` of
    silence. Bodies (requests, once decompressed) over ``max_body_mb`` are refused with 413
    (gRPC: RESOURCE_EXHAUSTED).
    """

    host: str = "127.0.0.1"
    port: int = 4318
    grpc_port: int = 4317
    complete_on_root: bool = True
    max_body_mb: int = 32

    def __post_init__(self) -> None:
        check = Checks("otlp", self)
        check.port("port")
        check.port("grpc_port", zero="no gRPC receiver")
        check.that(self.grpc_port != self.port,
                   f"grpc_port and otlp.port are both {self.port}: OTLP/gRPC and OTLP/HTTP need a port each")
        check.at_least("max_body_mb", 1)
