"""The [stack] section: the one-command local stack's ports, state folder and broker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentstream.infra.config.checks import Checks

BROKER_STORAGES = ("durable", "memory")
BROKERS = ("tansu", "kafka")


@dataclass(frozen=True)
class StackConfig:
    """The local stack `agentstream up` runs: loopback ports, the state folder, which broker and where it keeps data.

    ``broker`` is ``tansu`` (the default: one Rust process, starts in milliseconds) or ``kafka`` (Apache Kafka in
    KRaft mode on Java 17+, one node that is broker and controller; its jars from ``kafka_jars`` or the checkout's
    ``.kafka/`` that `make install` fills; its log dirs under ``<home>/kafka``, ``kafka_heap_mb`` of heap).
    ``broker_storage`` (tansu's; Kafka always logs to disk) is ``durable`` (the default: tansu stores every
    batch, watermark and group offset through a small S3-compatible object store over ``<home>/broker-data``,
    each write on disk before it is acknowledged, so a broker crash or ``down``/``up`` loses nothing) or
    ``memory`` (tansu's ``memory://``: faster, everything gone when the broker stops; for
    throwaway stacks). ``objectstore_port`` is where that object store listens; 0 picks a free
    loopback port at ``up`` (only the broker talks to it, and it finds it in the pidfile).
    """

    home: Path = Path(".agentstream")
    host: str = "127.0.0.1"
    broker_port: int = 9092
    clickhouse_port: int = 8123
    tansu_bin: str | None = None
    broker_storage: str = "durable"
    objectstore_port: int = 0
    broker: str = "tansu"
    kafka_jars: str | None = None
    kafka_heap_mb: int = 512

    def __post_init__(self) -> None:
        check = Checks("stack", self)
        check.port("broker_port")
        check.port("clickhouse_port")
        check.one_of("broker", BROKERS)
        check.at_least("kafka_heap_mb", 128)
        check.one_of("broker_storage", BROKER_STORAGES)
        check.port("objectstore_port", zero="any free port")
