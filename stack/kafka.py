"""Apache Kafka (KRaft mode) on the installed Java: locating its jars, writing a node's properties, formatting its
storage and building its command line.

`make install` fetches the broker's jars from Maven Central with Maven (``stack/apache-kafka.pom.xml``) into
``.kafka/<version>/jars`` in the checkout; :func:`kafka_jars` finds them there or at ``[stack] kafka_jars``. One
node is broker and controller at once; a cluster of several (tests, `make chaos --cluster`) is the same node
spec with a fixed voter list.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from agentstream.infra.processes import ServiceError

KAFKA_VERSION = "4.4.0"
"""The Apache Kafka release `make install` fetches (``stack/apache-kafka.pom.xml`` names the same)."""

MAIN_CLASS = "kafka.Kafka"
"""The broker's main class: what its java command line runs, and how a process is told to be the broker."""

CHECKOUT = Path(__file__).resolve().parents[1]
DEFAULT_JARS = CHECKOUT / ".kafka" / KAFKA_VERSION / "jars"


class KafkaNotInstalled(ServiceError):
    """No Java, or no Apache Kafka jars where the configuration says; the message says how to get them."""

    retriable = False


def find_java() -> Path:
    """The java executable: ``$JAVA_HOME/bin/java``, then PATH. Kafka 4.x needs Java 17 or later."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(Path(home) / "bin" / "java", os.X_OK):
        return Path(home) / "bin" / "java"
    found = shutil.which("java")
    if found is None:
        raise KafkaNotInstalled("no java on PATH (Apache Kafka 4.x needs Java 17+): install a JDK "
                                "(e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME")
    return Path(found)


def kafka_jars(configured: str | None = None) -> Path:
    """The folder of the broker's jars: ``configured`` (``[stack] kafka_jars``) or the checkout's Maven cache."""
    folder = Path(configured) if configured else DEFAULT_JARS
    if not any(folder.glob("kafka_2.13-*.jar")):
        where = f"[stack] kafka_jars = {configured}" if configured else str(folder)
        raise KafkaNotInstalled(f"no Apache Kafka jars in {where}: run `make install` (it fetches Kafka "
                                f"{KAFKA_VERSION} with Maven), or point AGENTSTREAM_KAFKA_JARS at a folder of them")
    return folder


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes in URL-safe base64 without padding, as `kafka-storage random-uuid`,
    and like it never starting with ``-`` (a command line would read such an id as an option)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass(frozen=True)
class KafkaNode:
    """One KRaft node (broker and controller) of a cluster on this machine.

    ``voters`` is the fixed controller quorum, ``"1@host:port,2@host:port,..."``; None makes a one-node cluster
    whose quorum is formatted as standalone. ``replication`` is the replication factor and minimum in-sync
    replicas of Kafka's internal topics (offsets, transactions, share groups). ``listeners`` maps extra listener
    names to ``(port, protocol)`` (SASL_SSL and friends, as tests need); ``settings`` overrides anything.
    """

    node_id: int
    host: str
    port: int
    controller_port: int
    log_dir: Path
    voters: str | None = None
    replication: int = 1
    min_insync: int = 1
    listeners: dict[str, tuple[int, str]] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def properties(self) -> dict[str, str]:
        """server.properties for this node, tuned for one machine: small internal topics, no rebalance delay,
        session timeouts down to 1 s (the pipeline's workers use 3 s), no topic created by a client's request."""
        names = {"PLAINTEXT": (self.port, "PLAINTEXT"), **self.listeners}
        listeners = [f"{name}://{self.host}:{port}" for name, (port, _protocol) in names.items()]
        protocols = [f"{name}:{protocol}" for name, (_port, protocol) in names.items()] + ["CONTROLLER:PLAINTEXT"]
        controller = f"{self.host}:{self.controller_port}"
        quorum = ({"controller.quorum.voters": self.voters} if self.voters else
                  {"controller.quorum.bootstrap.servers": controller})
        internal = str(self.replication)
        return {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "listeners": ",".join([*listeners, f"CONTROLLER://{controller}"]),
            "advertised.listeners": ",".join(listeners),
            "listener.security.protocol.map": ",".join(protocols),
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            **quorum,
            "log.dirs": str(self.log_dir),
            "num.partitions": "1",
            "default.replication.factor": internal,
            "min.insync.replicas": str(self.min_insync),
            "offsets.topic.replication.factor": internal,
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": internal,
            "transaction.state.log.min.isr": str(self.min_insync),
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": internal,
            "share.coordinator.state.topic.min.isr": str(self.min_insync),
            "group.initial.rebalance.delay.ms": "0",
            "group.min.session.timeout.ms": "1000",
            "auto.create.topics.enable": "false",
            **self.settings,
        }


def write_properties(path: Path, properties: dict[str, str]) -> Path:
    """Write a Java properties file (values are plain: no key of ours needs escaping beyond ``\\``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{key}={value.replace(chr(92), chr(92) * 2)}" for key, value in properties.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def is_formatted(node: KafkaNode) -> bool:
    return (node.log_dir / "meta.properties").is_file()


def format_storage(java: Path, jars: Path, node: KafkaNode, properties_path: Path, cluster_id: str,
                   scram_users: dict[str, str] | None = None) -> None:
    """Format the node's log dir for ``cluster_id`` once (a formatted dir is left as it is, data and all).

    ``scram_users`` (name -> password) are written into the cluster's first metadata as SCRAM-SHA-512 credentials,
    which is how a cluster whose brokers authenticate each other with SCRAM gets its first user.
    """
    if is_formatted(node):
        return
    command = [str(java), "-cp", f"{jars}/*", "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
               "-c", str(properties_path)]
    if node.voters is None:
        command.append("--standalone")
    for name, password in (scram_users or {}).items():
        command += ["--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise ServiceError(f"formatting Kafka storage in {node.log_dir} failed: {last}")


def kafka_command(java: Path, jars: Path, properties_path: Path, heap_mb: int = 512,
                  jvm_options: tuple[str, ...] = ()) -> list[str]:
    """The command line of one node: ``kafka.Kafka server.properties`` on a bounded heap, warnings and up logged
    (slf4j-simple, which `make install` fetches beside the broker), plus the server's start line."""
    return [str(java), f"-Xmx{heap_mb}m", f"-Xms{min(heap_mb, 128)}m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "-Dorg.slf4j.simpleLogger.log.kafka.server.KafkaRaftServer=info",
            "-Dorg.slf4j.simpleLogger.showDateTime=true", *jvm_options,
            "-cp", f"{jars}/*", MAIN_CLASS, str(properties_path)]
