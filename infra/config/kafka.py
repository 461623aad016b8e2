"""The Kafka sections: where the cluster is and how clients reach it ([kafka]), and the product topics ([topics])."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.checks import Checks
from agentstream.infra.config.errors import Secret

IDEMPOTENCE = ("auto", "on", "off")


@dataclass(frozen=True)
class KafkaConfig:
    """Where the Kafka cluster is and how to authenticate; None bootstrap means the embedded broker.

    ``fetch_max_wait_ms`` is how long the pipeline's consumers (runners, trainer, hot swap, gate,
    deployment followers) let the broker hold a fetch that finds nothing. tansu answers such a
    fetch only when the wait is over, even if records arrive meanwhile, so it is the latency of
    every hop: at aiokafka's 500 ms a task reached its runner and a transition its trainer up to
    half a second late, once per policy version. The stream processors have their own
    (``streams.fetch_max_wait_ms``).

    ``read_gap_patience_s`` is how long a consumer of tasks, spans or transitions reads a hole in a
    partition's offsets again before it reads past it (:mod:`agentstream.infra.gaps`: tansu's durable
    storage takes a batch's offsets before it stores the batch).

    ``idempotence`` is how producers avoid writing a record twice when they retry a send whose
    acknowledgement was lost: ``on`` (every producer is idempotent; a broker without it is an error),
    ``off``, or ``auto`` (the default: on wherever the broker grants a producer id, which Apache Kafka,
    Redpanda and the managed services do; off, with one warning, on tansu 0.6, which does not).
    """

    bootstrap_servers: str | None = None
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: Secret | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    client_id: str = "agentstream"
    fetch_max_wait_ms: int = 50
    idempotence: str = "auto"
    read_gap_patience_s: float = 2.0

    def __post_init__(self) -> None:
        check = Checks("kafka", self)
        check.one_of("idempotence", IDEMPOTENCE)
        check.at_least("fetch_max_wait_ms", 1)
        check.at_least("read_gap_patience_s", 0)

    @property
    def external(self) -> bool:
        return self.bootstrap_servers is not None


@dataclass(frozen=True)
class TopicsConfig:
    """Names and layout of the product topics (all share one prefix)."""

    prefix: str = "agentstream."
    partitions: int = 4
    replication_factor: int = 1
    retention_ms: int = 7 * 24 * 3600 * 1000

    def __post_init__(self) -> None:
        Checks("topics", self).at_least("partitions", 1)
