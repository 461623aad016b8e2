"""Kafka connection options and admin helpers (topics, message counts, consumer groups) on aiokafka."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.conn import create_conn
from aiokafka.errors import (
    BrokerResponseError,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    IllegalSaslStateError,
    InvalidSessionTimeoutError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.protocol.transaction import InitProducerIdRequest

from agentstream.infra.config import Config, KafkaConfig, TopicsConfig
from agentstream.schemas.errors import AgentstreamError

# Kafka error codes we treat specially when creating topics.
TOPIC_ALREADY_EXISTS = 36
TOPIC_AUTHORIZATION_FAILED = 29

log = logging.getLogger("agentstream.kafka")


class KafkaSetupError(AgentstreamError, RuntimeError):
    """A topic could not be created or does not have the layout agentstream needs."""


class KafkaUnreachable(KafkaSetupError):
    """No Kafka broker answered metadata requests in time; it may answer later."""

    retriable = True


class IdempotenceUnsupported(KafkaSetupError):
    """``[kafka] idempotence = "on"`` but the broker grants no producer id (tansu 0.6 does not)."""

    retriable = False


@dataclass(frozen=True)
class TopicSpec:
    """One topic agentstream owns: its full name, partition count and topic-level configs."""

    role: str
    name: str
    partitions: int
    configs: dict[str, str] = field(default_factory=dict)


def client_options(kafka: KafkaConfig, bootstrap_servers: str) -> dict[str, Any]:
    """Keyword arguments shared by every aiokafka producer, consumer and admin client."""
    options: dict[str, Any] = {
        "bootstrap_servers": bootstrap_servers,
        "client_id": kafka.client_id,
        "security_protocol": kafka.security_protocol,
    }
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = create_ssl_context(
            cafile=kafka.ssl_cafile, certfile=kafka.ssl_certfile, keyfile=kafka.ssl_keyfile
        )
    if kafka.sasl_mechanism:
        options["sasl_mechanism"] = kafka.sasl_mechanism
        options["sasl_plain_username"] = kafka.sasl_username
        options["sasl_plain_password"] = kafka.sasl_password.reveal() if kafka.sasl_password else None
    return options


def consumer_options(kafka: KafkaConfig, bootstrap_servers: str) -> dict[str, Any]:
    """``client_options`` plus what every pipeline consumer shares: the broker's longest wait on an empty fetch."""
    return {**client_options(kafka, bootstrap_servers), "fetch_max_wait_ms": kafka.fetch_max_wait_ms}


CLIENT_OPTION_KEYS = ("bootstrap_servers", "client_id", "security_protocol", "ssl_context", "sasl_mechanism",
                      "sasl_plain_username", "sasl_plain_password", "request_timeout_ms")
PRODUCER_ID_RETRIABLE = {14, 15, 51}  # coordinator loading or not available, concurrent transactions
PRODUCER_ID_TRIES = 20
_granted: dict[str, bool] = {}  # bootstrap servers -> whether that cluster grants producer ids


async def start_producer(kafka: KafkaConfig, options: dict[str, Any], **settings: Any) -> AIOKafkaProducer:
    """A started producer on ``options`` (:func:`client_options`): ``acks=all``, idempotent as ``[kafka]
    idempotence`` says, plus ``settings``. An idempotent producer numbers its batches, so a retry after a lost
    acknowledgement (a leader that died after writing) is dropped by the broker instead of stored twice."""
    idempotent = await idempotence_granted(kafka.idempotence, options)
    producer = AIOKafkaProducer(**{"acks": "all", **options, **settings, "enable_idempotence": idempotent})
    try:
        await producer.start()
    except BaseException:
        await producer.stop()
        raise
    return producer


async def idempotence_granted(mode: str, options: dict[str, Any]) -> bool:
    """Whether producers on this cluster are idempotent: ``off`` never; ``on`` always (IdempotenceUnsupported where
    the broker grants no producer id); ``auto`` where it does, asked once per process and cluster.

    The question is an InitProducerId request, the one an idempotent producer sends first: Apache Kafka grants an
    id (after a moment's "loading" on a fresh cluster, retried here); tansu 0.6 answers UnknownError. A broker that
    cannot be reached raises aiokafka's connection error, as starting a producer would.
    """
    if mode == "off":
        return False
    servers = str(options["bootstrap_servers"])
    if servers not in _granted:
        error = await _producer_id_error(options)
        if error and mode == "auto":
            log.warning("Kafka at %s grants no producer id (error %d): producers are not idempotent, so a send "
                        "retried after a lost acknowledgement can store a record twice (ids make it harmless)",
                        servers, error)
        _granted[servers] = not error
    if mode == "on" and not _granted[servers]:
        raise IdempotenceUnsupported(f"[kafka] idempotence = \"on\" but Kafka at {servers} grants no producer id "
                                     "(tansu 0.6 does not): set it to \"auto\" or \"off\" for this broker")
    return _granted[servers]


async def _producer_id_error(options: dict[str, Any]) -> int:
    """The error code of an InitProducerId request (0: granted), retried while the cluster is still loading."""
    client = AIOKafkaClient(**{key: options[key] for key in CLIENT_OPTION_KEYS if key in options})
    try:
        await client.bootstrap()
        for _ in range(PRODUCER_ID_TRIES):
            node = client.get_random_node()
            response = await client.send(node, InitProducerIdRequest(transactional_id=None,
                                                                     transaction_timeout_ms=60_000))
            if response.error_code not in PRODUCER_ID_RETRIABLE:
                return int(response.error_code)
            await asyncio.sleep(0.25)
        return int(response.error_code)
    finally:
        await client.close()


def topic_name(topics: TopicsConfig, role: str) -> str:
    return f"{topics.prefix}{role}"


def product_topics(topics: TopicsConfig) -> list[TopicSpec]:
    """The product topics: checkpoints and deployments are compacted (the latest event per model wins)."""
    retention = {"cleanup.policy": "delete", "retention.ms": str(topics.retention_ms)}
    return [
        TopicSpec("tasks", topic_name(topics, "tasks"), topics.partitions, retention),
        TopicSpec("spans", topic_name(topics, "spans"), topics.partitions, retention),
        TopicSpec("transitions", topic_name(topics, "transitions"), topics.partitions, retention),
        TopicSpec("checkpoints", topic_name(topics, "checkpoints"), 1, {"cleanup.policy": "compact"}),
        TopicSpec("deployments", topic_name(topics, "deployments"), 1, {"cleanup.policy": "compact"}),
        TopicSpec("dlq", topic_name(topics, "dlq"), 1, retention),
    ]


async def ensure_topics(admin: AIOKafkaAdminClient, specs: list[TopicSpec], replication_factor: int = 1) -> list[str]:
    """Create the topics that are missing; returns the names created. Existing topics are checked, not altered.

    A topic with three replicas or more gets ``min.insync.replicas`` one below its replication factor (unless its
    spec says otherwise): with ``acks=all`` a write of a three-replica topic is then acknowledged only once two
    replicas hold it, and one broker may be down without stopping writes.

    On a cluster with ACLs a principal sees only the topics it may describe, and a role may neither see nor
    create the topics of other roles: those are left to the operator (one info line), not an error. A topic
    the role uses and was not granted fails where it is used, with :class:`KafkaAccessDenied`.
    """
    existing = set(await admin.list_topics())
    missing = [spec for spec in specs if spec.name not in existing]
    created: list[str] = []
    insync = {"min.insync.replicas": str(replication_factor - 1)} if replication_factor > 2 else {}
    hidden: set[str] = set()
    if missing:
        response = await admin.create_topics(
            [NewTopic(s.name, s.partitions, replication_factor, topic_configs={**insync, **s.configs})
             for s in missing]
        )
        for name, code, message in response.topic_errors:
            if code == 0:
                created.append(name)
            elif code == TOPIC_AUTHORIZATION_FAILED:
                hidden.add(name)
            elif code != TOPIC_ALREADY_EXISTS:
                raise KafkaSetupError(f"could not create topic {name}: error {code} {message or ''}".strip())
    if hidden:
        log.info("not allowed to see or create topics %s: left to the cluster's operator", ", ".join(sorted(hidden)))
    await wait_for_layout(admin, [s.name for s in specs if s.name not in hidden])
    return created


async def wait_for_layout(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float = 15.0) -> None:
    """Wait until every broker reports every topic in ``names`` with its partitions, or raise KafkaSetupError.

    On a cluster of several brokers a topic the controller just created reaches the other brokers' metadata a
    moment later (measured: a worker asking right after the creation was told the topic had no partitions).
    Every broker is asked, because the next client may ask any of them: a loaded three-node cluster once had a
    topic on the broker this wait asked and not yet on the one the caller's next describe went to.
    """
    if not names:
        return
    client = admin._client  # the admin's connections: aiokafka's admin has no per-broker metadata call
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        missing = await _missing_on_some_broker(client, names)
        if not missing:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise KafkaSetupError(f"topic {missing[0]} exists but reports no partitions after {timeout_s:.0f}s")
        await asyncio.sleep(0.1)


async def _missing_on_some_broker(client: AIOKafkaClient, names: list[str]) -> list[str]:
    """The topics of ``names`` that some broker of the cluster reports without partitions (or not at all)."""
    await client.force_metadata_update()
    missing: set[str] = set()
    for broker in client.cluster.brokers():
        try:
            response = await client.send(broker.nodeId, MetadataRequest(names, allow_auto_topic_creation=False))
        except KafkaError:  # a broker that is down answers nobody; the others are what clients reach
            continue
        ready = {topic for error_code, topic, *_, partitions in response.topics if error_code == 0 and partitions}
        missing.update(name for name in names if name not in ready)
    return sorted(missing)


async def topic_partitions(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    """Partition count per topic name, for the topics that exist."""
    described = await admin.describe_topics(names)
    return {t["topic"]: len(t["partitions"]) for t in described if t["error_code"] == 0}


async def message_counts(options: dict[str, Any], partitions: dict[str, int], timeout_ms: int = 500) -> dict[str, int]:
    """Messages currently held per topic (high watermark minus log start, summed over partitions).

    The high watermark is read from a Fetch response: tansu answers ListOffsets(latest) with a
    value that can be too low, and a Fetch from there reports the true high watermark.
    """
    tps = [TopicPartition(topic, p) for topic, count in partitions.items() for p in range(count)]
    if not tps:
        return {}
    consumer = AIOKafkaConsumer(**options, enable_auto_commit=False, fetch_max_bytes=1 << 16,
                                max_partition_fetch_bytes=1 << 12)
    await consumer.start()
    try:
        consumer.assign(tps)
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, ends[tp])
        await consumer.getmany(timeout_ms=timeout_ms)
        counts: dict[str, int] = {name: 0 for name in partitions}
        for tp in tps:
            high = max(consumer.highwater(tp) or 0, ends[tp])
            counts[tp.topic] += max(0, high - starts[tp])
        return counts
    finally:
        await consumer.stop()


async def consumer_groups(admin: AIOKafkaAdminClient) -> list[str]:
    groups = await admin.list_consumer_groups()
    return sorted(group_id for group_id, _protocol in groups)


async def wait_for_broker(options: dict[str, Any], timeout_s: float) -> None:
    """Wait until the cluster answers metadata requests, or raise KafkaUnreachable."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last_error: Exception | None = None
    while asyncio.get_running_loop().time() < deadline:
        admin = AIOKafkaAdminClient(**options, request_timeout_ms=3000)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except Exception as error:  # any connection failure means "not yet"
            last_error = error
            await asyncio.sleep(0.2)
        finally:
            await admin.close()
    refused = "Connect call failed" in str(last_error) or "Unable to bootstrap" in str(last_error)
    reason = "connection refused" if refused else last_error
    raise KafkaUnreachable(f"Kafka at {options['bootstrap_servers']} did not answer within {timeout_s:.0f}s ({reason})")


def admin_client(config: Config, bootstrap_servers: str) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**client_options(config.kafka, bootstrap_servers))


async def create_topics(config: Config, bootstrap_servers: str, specs: list[TopicSpec] | None = None) -> list[str]:
    """Create the missing topics among ``specs`` (default: the product topics); returns the names created."""
    admin = admin_client(config, bootstrap_servers)
    await admin.start()
    try:
        return await ensure_topics(admin, product_topics(config.topics) if specs is None else specs,
                                   config.topics.replication_factor)
    finally:
        await admin.close()


# --- Refusals by a secured cluster (#47): a wrong password or a missing ACL is a named, non-retriable error. ---
# aiokafka 0.14 raises TopicAuthorizationFailedError, GroupAuthorizationFailedError and friends (retriable False)
# for a missing ACL, but answers a refused SASL login (or an untrusted certificate) only with
# KafkaConnectionError("Unable to bootstrap from ..."), the same as a broker that is down, and logs the cause.
# So a failed bootstrap is diagnosed with one connection of our own (:func:`authentication_problem`).

AUTHORIZATION_ERRORS: tuple[type[BrokerResponseError], ...] = (
    TopicAuthorizationFailedError, GroupAuthorizationFailedError, ClusterAuthorizationFailedError,
    TransactionalIdAuthorizationFailed)
"""What aiokafka raises when the cluster's ACLs refuse the principal (codes 29, 30, 31, 53)."""

SASL_ERRORS: tuple[type[BrokerResponseError], ...] = (
    SaslAuthenticationFailed, UnsupportedSaslMechanismError, IllegalSaslStateError)


class KafkaRefused(KafkaSetupError):
    """The cluster refused this client for good: asking again with the same credentials gets the same answer."""

    retriable = False


class KafkaAuthenticationFailed(KafkaRefused):
    """The SASL login was refused (wrong user, password or mechanism) or the broker's certificate is not trusted."""


class KafkaAccessDenied(KafkaRefused):
    """The cluster's ACLs do not allow this principal an operation on a topic, group, cluster or transactional id."""


class SessionTimeoutRefused(KafkaSetupError):
    """The group coordinator refused the consumer's session timeout (InvalidSessionTimeoutError, error 26, at the
    first join): it is outside the broker's ``group.min.session.timeout.ms`` .. ``group.max.session.timeout.ms``."""

    retriable = False


def session_timeout_refused(setting: str, session_timeout_s: float) -> SessionTimeoutRefused:
    """The named error for a refused session, saying which of agentstream's settings (``setting``) to raise.

    The embedded broker allows sessions down to 1 s; a stock Apache Kafka broker only from 6 s, so the stream
    workers' 3 s and the trainer's and runners' 4 s defaults are refused there.
    """
    return SessionTimeoutRefused(f"Kafka refused a consumer session of {session_timeout_s:g} s "
                                 f"(InvalidSessionTimeoutError): set {setting} to at least the broker's "
                                 "group.min.session.timeout.ms, 6 s by default")


@contextlib.contextmanager
def session_timeout_checked(setting: str, session_timeout_s: float) -> Iterator[None]:
    """Turn aiokafka's InvalidSessionTimeoutError inside the block into :func:`session_timeout_refused`: a subscribed
    consumer's ``start()`` waits for its first join and raises it there; the consumer never joins."""
    try:
        yield
    except InvalidSessionTimeoutError as error:
        raise session_timeout_refused(setting, session_timeout_s) from error


def principal(options: dict[str, Any]) -> str:
    """Who a client with these options is to the broker, for error lines: ``User:name (SASL_SSL/SCRAM-SHA-512)``."""
    protocol = options.get("security_protocol", "PLAINTEXT")
    if options.get("sasl_mechanism"):
        return f"User:{options.get('sasl_plain_username')} ({protocol}/{options['sasl_mechanism']})"
    return f"the unauthenticated principal ({protocol})"


def access_denied(options: dict[str, Any], error: BrokerResponseError, operation: str) -> KafkaAccessDenied:
    """The named error for an aiokafka authorization refusal: who, which resource, what it was doing."""
    kinds = {TopicAuthorizationFailedError: "topic", GroupAuthorizationFailedError: "group",
             ClusterAuthorizationFailedError: "cluster", TransactionalIdAuthorizationFailed: "transactional id"}
    kind = next((name for cls, name in kinds.items() if isinstance(error, cls)), "resource")
    names = ", ".join(str(arg) for arg in error.args if arg) or "?"
    return KafkaAccessDenied(f"Kafka at {options.get('bootstrap_servers')} refused {principal(options)}: {operation} "
                             f"needs an ACL on {kind} {names} that this principal lacks ({type(error).__name__}); "
                             "`agentstream kafka-acls` prints the ACLs of each role")


async def authentication_problem(options: dict[str, Any], timeout_s: float = 10.0) -> KafkaAuthenticationFailed | None:
    """After a failed bootstrap: log in once to each bootstrap address; the named error if the login was refused.

    None when no address answered (the broker is down or unreachable: the caller's retry policy applies).
    """
    for address in options["bootstrap_servers"].split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            connection = await asyncio.wait_for(create_conn(
                host.strip("[]"), int(port), client_id=options.get("client_id", "agentstream"),
                ssl_context=options.get("ssl_context"), security_protocol=options.get("security_protocol", "PLAINTEXT"),
                sasl_mechanism=options.get("sasl_mechanism"), sasl_plain_username=options.get("sasl_plain_username"),
                sasl_plain_password=options.get("sasl_plain_password")), timeout_s)
        except SASL_ERRORS as error:
            return KafkaAuthenticationFailed(f"Kafka at {address} refused the login of {principal(options)}: {error}")
        except ssl.SSLError as error:
            return KafkaAuthenticationFailed(f"TLS with Kafka at {address} failed for {principal(options)}: "
                                             f"{error} (check ssl_cafile)")
        except (OSError, TimeoutError, ValueError, KafkaError):
            continue
        connection.close()
    return None


async def refusal(options: dict[str, Any], error: BaseException, operation: str) -> KafkaRefused | None:
    """The named refusal behind an aiokafka error, if it is one: an ACL refusal, or a failed bootstrap whose login
    was refused. None for anything else (an unreachable broker, a timeout), which the caller handles as before."""
    if isinstance(error, AUTHORIZATION_ERRORS):
        return access_denied(options, error, operation)
    if isinstance(error, KafkaConnectionError):
        return await authentication_problem(options)
    return None


@contextlib.asynccontextmanager
async def named_refusals(options: dict[str, Any], operation: str) -> AsyncIterator[None]:
    """Turn a refusal by the cluster inside the block into :class:`KafkaAccessDenied` or
    :class:`KafkaAuthenticationFailed` (one line, ``retriable = False``); other errors pass unchanged."""
    try:
        yield
    except (KafkaError, TimeoutError) as error:
        named = await refusal(options, error, operation)
        if named is None:
            raise
        raise named from error


CONNECTION_OPTIONS = ("bootstrap_servers", "client_id", "security_protocol", "ssl_context", "sasl_mechanism",
                      "sasl_plain_username", "sasl_plain_password")
"""The keys of :func:`client_options` that every aiokafka client takes (consumer options add their own)."""


async def check_topic_access(options: dict[str, Any], topics: list[str], operation: str) -> None:
    """Ask the cluster for these topics' metadata; TopicAuthorizationFailedError if it refuses to describe one.

    A consumer that assigns itself an unauthorized partition does not raise in aiokafka 0.14: it logs
    "Topic ... is not authorized" and fetches nothing, forever. Read and Write both imply Describe, so a
    principal that may read a topic may describe it. Connection failures pass through as aiokafka raises them.
    """
    client = AIOKafkaClient(**{key: value for key, value in options.items() if key in CONNECTION_OPTIONS})
    try:
        await client.bootstrap()
        response = await client.send(client.get_random_node(), MetadataRequest(topics, allow_auto_topic_creation=False))
    finally:
        await client.close()
    for error_code, topic, *_ in response.topics:
        if error_code == TOPIC_AUTHORIZATION_FAILED:
            raise TopicAuthorizationFailedError(topic)
