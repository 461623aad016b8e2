"""The local stack: start, inspect and stop the broker and ClickHouse that agentstream uses.

Each service is either external (``KAFKA_BOOTSTRAP_SERVERS`` / ``CLICKHOUSE_URL``: nothing
is started) or embedded: tansu (or Apache Kafka, ``[stack] broker = "kafka"``, :mod:`agentstream.stack.kafka`) and the
chdb ClickHouse HTTP server, on loopback, tracked by
pidfiles under the stack home so ``down`` stops exactly what ``up`` started. An embedded
broker with durable storage (the default) keeps its data through a third process, the
S3-compatible object store over ``<home>/broker-data`` (:mod:`agentstream.stack.objectstore`), started
before tansu and stopped after it; it listens on 127.0.0.1 whatever ``stack.host`` says, since only
the local broker talks to it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentstream.infra.clickhouse import migrate, table_counts, wait_for_clickhouse
from agentstream.infra.config import CHECKPOINT_BUCKET, OBJECTSTORE_SERVICE, Config, dump_toml
from agentstream.infra.kafka import (
    admin_client,
    client_options,
    consumer_groups,
    create_topics,
    message_counts,
    topic_partitions,
    wait_for_broker,
)
from agentstream.infra.processes import ServiceDirectory, free_port, port_is_free
from agentstream.infra.security import KeySet, OpenBindRefused, check_bind, is_loopback
from agentstream.stack.broker import BUCKET, MEMORY_STORAGE, find_tansu, s3_storage, tansu_command
from agentstream.stack.chaccess import Users
from agentstream.stack.kafka import (
    KAFKA_VERSION,
    KafkaNode,
    find_java,
    format_storage,
    kafka_command,
    kafka_jars,
    new_cluster_id,
    write_properties,
)
from agentstream.stack.objectstore import HOST as OBJECTSTORE_HOST
from agentstream.stack.registry_server.service import SCHEMA_REGISTRY, registry_state, start_registry

BROKER = "broker"
CLICKHOUSE = "clickhouse"
OBJECTSTORE = OBJECTSTORE_SERVICE


@dataclass(frozen=True)
class Endpoints:
    """Where the components reach Kafka and ClickHouse."""

    bootstrap_servers: str
    clickhouse_url: str


@dataclass
class StackStatus:
    """What `agentstream status` reports."""

    endpoints: Endpoints
    services: dict[str, str]
    broker_reachable: bool
    broker_error: str | None = None
    topics: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (partitions, messages)
    groups: list[str] = field(default_factory=list)
    clickhouse_version: str | None = None
    clickhouse_error: str | None = None
    tables: dict[str, int] = field(default_factory=dict)

    @property
    def nothing_running(self) -> bool:
        """Neither service is external or a live process that `up` started."""
        return not any(state == "external" or state.endswith(" running") for state in self.services.values())


class Stack:
    """The broker and ClickHouse for one configuration and state folder."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.home = config.stack.home.resolve()
        self.services = ServiceDirectory(self.home)

    def endpoints(self) -> Endpoints:
        """External addresses when configured; otherwise where the embedded services listen (or will)."""
        stack = self.config.stack
        broker = self.config.kafka.bootstrap_servers
        if broker is None:
            record = self.services.record(BROKER)
            broker = record.address if record and record.alive() else f"{stack.host}:{stack.broker_port}"
        clickhouse = self.config.clickhouse.url
        if clickhouse is None:
            record = self.services.record(CLICKHOUSE)
            address = record.address if record and record.alive() else f"{stack.host}:{stack.clickhouse_port}"
            clickhouse = f"http://{address}"
        return Endpoints(broker, clickhouse)

    def up(self, timeout_s: float = 60.0, progress=print) -> Endpoints:
        """Start what is embedded, wait until both answer, create topics and tables."""
        stack = self.config.stack
        self.check_binds()
        if not self.config.kafka.external:
            # the object store holds tansu's data and, for either broker, the embedded checkpoint bucket
            storage, environment = self._broker_storage(timeout_s, progress)
            if stack.broker == "kafka":
                record = self.services.start(BROKER, self._kafka_command(), stack.host, stack.broker_port,
                                             timeout_s)
                progress(f"broker      Apache Kafka {KAFKA_VERSION} pid {record.pid} on {record.address} "
                         f"(data {self.home / 'kafka'}, log {record.log_path})")
            else:
                binary = find_tansu(stack.tansu_bin, self.home)
                record = self.services.start(BROKER, tansu_command(binary, stack.host, stack.broker_port, storage),
                                             stack.host, stack.broker_port, timeout_s, env=environment)
                progress(f"broker      tansu pid {record.pid} on {record.address} (log {record.log_path})")
        if not self.config.clickhouse.external:
            data_dir = self.home / "clickhouse"
            settings_file = self.services.private_file("clickhouse.toml", dump_toml(self.config))
            command = [sys.executable, "-m", "agentstream.stack.chserver", "--host", stack.host,
                       "--port", str(stack.clickhouse_port), "--data-dir", str(data_dir),
                       "--config", str(settings_file)]
            record = self.services.start(CLICKHOUSE, command, stack.host, stack.clickhouse_port, timeout_s)
            progress(f"clickhouse  chdb pid {record.pid} on http://{record.address} (data {data_dir})")
        endpoints = self.endpoints()
        created = asyncio.run(self._prepare_kafka(endpoints, timeout_s))
        progress(f"kafka       {endpoints.bootstrap_servers}: topics ready"
                 + (f" (created {', '.join(created)})" if created else ""))
        start_registry(self.config, self.services, endpoints.bootstrap_servers, timeout_s, progress)
        client = wait_for_clickhouse(self.config.clickhouse, endpoints.clickhouse_url, timeout_s)
        applied = migrate(client, self.config.clickhouse.database)
        progress(f"clickhouse  {endpoints.clickhouse_url} (ClickHouse {client.server_version}): "
                 f"database {self.config.clickhouse.database} ready"
                 + (f" (applied {', '.join(f'{m.version:04d}_{m.name}' for m in applied)})" if applied else ""))
        client.close()
        return endpoints

    def check_binds(self) -> None:
        """Refuse, in one line and before anything starts, to serve the embedded ClickHouse or Schema Registry
        beyond loopback without their keys, and the embedded broker there at all unless ``allow_open_bind``:
        tansu checks no credential, so on a reachable address anyone could read or write every topic."""
        security = self.config.security
        if not self.config.clickhouse.external:
            Users.from_config(self.config)  # a malformed clickhouse_readers is refused here, not in a child's log
            check_bind("embedded ClickHouse", self.config.stack.host, KeySet(self.config.clickhouse.password),
                       "[clickhouse] password", security)
        if not self.config.schema_registry.external:
            check_bind("Schema Registry", self.config.stack.host, KeySet(security.registry_keys), "registry_keys",
                       security)
        host = self.config.stack.host
        if not self.config.kafka.external and not is_loopback(host) and not security.allow_open_bind:
            raise OpenBindRefused(
                f"refusing to serve the embedded Kafka broker on {host}: it checks no credential, so anyone who "
                "reaches it could read or write every topic. Listen on 127.0.0.1, use your own Kafka "
                "(KAFKA_BOOTSTRAP_SERVERS), or set [security] allow_open_bind = true")

    def _kafka_command(self) -> list[str]:
        """One KRaft node under ``<home>/kafka``: formatted on the first `up`, its data kept by every later one.

        The controller listens on a port picked at the first `up` and kept in ``controller-port``: a one-node
        quorum records its controller's address when formatted, so that address may not move.
        """
        stack = self.config.stack
        java, jars = find_java(), kafka_jars(stack.kafka_jars)
        folder = self.kafka_data
        folder.mkdir(parents=True, exist_ok=True)
        port_file = folder / "controller-port"
        if not port_file.is_file():
            port_file.write_text(str(free_port(stack.host)))
        node = KafkaNode(1, stack.host, stack.broker_port, int(port_file.read_text()), folder / "data")
        properties = write_properties(folder / "server.properties", node.properties())
        format_storage(java, jars, node, properties, new_cluster_id())
        return kafka_command(java, jars, properties, stack.kafka_heap_mb)

    @property
    def broker_data(self) -> Path:
        """The folder where the durable broker's objects live."""
        return self.home / "broker-data"

    @property
    def kafka_data(self) -> Path:
        """The folder of the embedded Apache Kafka node (``[stack] broker = "kafka"``): its settings and logs."""
        return self.home / "kafka"

    @property
    def records_data(self) -> Path:
        """Where the embedded broker keeps the records: Kafka's folder, or tansu's objects."""
        return self.kafka_data if self.config.stack.broker == "kafka" else self.broker_data

    def _broker_storage(self, timeout_s: float, progress: Callable[[str], object]
                        ) -> tuple[str, dict[str, str] | None]:
        """tansu's storage URL and environment; for durable storage, start the object store first.

        With ``objectstore_port = 0`` a restarted object store takes the port it had before when
        that is free, so a broker still running keeps reaching it.
        """
        stack = self.config.stack
        if stack.broker_storage == "memory":
            return MEMORY_STORAGE, None
        previous = self.services.record(OBJECTSTORE)
        port = stack.objectstore_port
        if not port and previous is not None:
            old_port = int(previous.address.rpartition(":")[2])
            port = old_port if previous.alive() or port_is_free(OBJECTSTORE_HOST, old_port) else 0
        port = port or free_port(OBJECTSTORE_HOST)
        command = [sys.executable, "-m", "agentstream.stack.objectstore", "--port", str(port),
                   "--root", str(self.broker_data), "--bucket", BUCKET, "--bucket", CHECKPOINT_BUCKET]
        record = self.services.start(OBJECTSTORE, command, OBJECTSTORE_HOST, port, timeout_s)
        progress(f"objectstore pid {record.pid} on http://{record.address} (broker data {self.broker_data})")
        return s3_storage(f"http://{record.address}")

    async def _prepare_kafka(self, endpoints: Endpoints, timeout_s: float) -> list[str]:
        options = client_options(self.config.kafka, endpoints.bootstrap_servers)
        await wait_for_broker(options, timeout_s)
        return await create_topics(self.config, endpoints.bootstrap_servers)

    def status(self) -> StackStatus:
        endpoints = self.endpoints()
        services = {}
        for name, external in ((BROKER, self.config.kafka.external), (CLICKHOUSE, self.config.clickhouse.external)):
            record = self.services.record(name)
            if external:
                services[name] = "external"
            elif record is None:
                services[name] = "not started by agentstream"
            else:
                services[name] = f"pid {record.pid} " + ("running" if record.alive()
                                                         else "DEAD (see " + record.log_path + ")")
        if not self.config.kafka.external and (self.config.stack.broker_storage == "durable"
                                                or self.services.record(OBJECTSTORE) is not None):
            record = self.services.record(OBJECTSTORE)
            services[OBJECTSTORE] = ("not started by agentstream" if record is None else
                                     f"pid {record.pid} " + ("running" if record.alive()
                                                             else "DEAD (see " + record.log_path + ")"))
        services[SCHEMA_REGISTRY] = registry_state(self.config, self.services)
        report = StackStatus(endpoints, services, broker_reachable=False)
        try:
            asyncio.run(self._kafka_status(report))
            report.broker_reachable = True
        except Exception as error:
            report.broker_error = str(error).splitlines()[0] if str(error) else type(error).__name__
        try:
            client = wait_for_clickhouse(self.config.clickhouse, endpoints.clickhouse_url, timeout_s=0)
            report.clickhouse_version = client.server_version
            report.tables = table_counts(client, self.config.clickhouse.database)
            client.close()
        except Exception as error:
            report.clickhouse_error = str(error).splitlines()[0]
        return report

    async def _kafka_status(self, report: StackStatus) -> None:
        options = client_options(self.config.kafka, report.endpoints.bootstrap_servers)
        await wait_for_broker(options, timeout_s=3)
        admin = admin_client(self.config, report.endpoints.bootstrap_servers)
        await admin.start()
        try:
            names = [name for name in await admin.list_topics() if name.startswith(self.config.topics.prefix)]
            partitions = await topic_partitions(admin, names) if names else {}
            counts = await message_counts(options, partitions)
            report.topics = {name: (partitions[name], counts.get(name, 0)) for name in sorted(partitions)}
            report.groups = await consumer_groups(admin)
        finally:
            await admin.close()

    def down(self, progress=print) -> None:
        """Stop the services this stack home started: ClickHouse first so it flushes while Kafka is still up,
        the object store last so the broker can finish its writes."""
        for name in (SCHEMA_REGISTRY, CLICKHOUSE, BROKER, OBJECTSTORE):
            progress(f"{name:<11} {self.services.stop(name)}")
