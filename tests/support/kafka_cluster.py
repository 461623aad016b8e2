"""A three-node Apache Kafka cluster (KRaft) on loopback that a test may kill, stop, pause and restart node by node.

Each node is broker and controller; the controller quorum is the fixed voter list of all three. Topics and
Kafka's internal topics get replication factor 3 and ``min.insync.replicas`` 2, so ``acks=all`` survives one node
down and refuses writes with two down. Every process is signalled by its own PID only.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from agentstream.infra.processes import free_port, wait_for_port
from agentstream.stack.kafka import (
    KafkaNode,
    find_java,
    format_storage,
    kafka_command,
    kafka_jars,
    new_cluster_id,
    write_properties,
)

HOST = "127.0.0.1"


@dataclass
class NodeProcess:
    """One node's spec, its properties file and log, and its process while it runs."""

    node: KafkaNode
    properties: Path
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class KafkaCluster:
    """Three KRaft nodes under ``home``; ``start`` returns once all brokers are registered with the quorum."""

    def __init__(self, home: Path, size: int = 3, heap_mb: int = 384, settings: dict[str, str] | None = None) -> None:
        """``size`` nodes under ``home``; ``settings`` override server.properties keys on every node."""
        self.home, self.heap_mb = home, heap_mb
        self.java, self.jars = find_java(), kafka_jars()
        self.cluster_id = new_cluster_id()
        ports = [(free_port(HOST), free_port(HOST)) for _ in range(size)]
        voters = ",".join(f"{i + 1}@{HOST}:{controller}" for i, (_, controller) in enumerate(ports))
        self.nodes: dict[int, NodeProcess] = {}
        for index, (port, controller) in enumerate(ports):
            node_id = index + 1
            folder = home / f"node{node_id}"
            node = KafkaNode(node_id, HOST, port, controller, folder / "data", voters=voters,
                             replication=min(3, size), min_insync=min(2, size),
                             settings={"replica.lag.time.max.ms": "5000", **(settings or {})})
            self.nodes[node_id] = NodeProcess(node, folder / "server.properties", folder / "kafka.log")

    @property
    def bootstrap_servers(self) -> str:
        """Every node's address: clients find the cluster through whichever answers."""
        return ",".join(node.node.bootstrap for node in self.nodes.values())

    def start(self, timeout_s: float = 120.0) -> KafkaCluster:
        """Format each node's storage with the one cluster id, start all three and wait until they form a cluster."""
        for member in self.nodes.values():
            write_properties(member.properties, member.node.properties())
            format_storage(self.java, self.jars, member.node, member.properties, self.cluster_id)
        for node_id in self.nodes:
            self._launch(node_id)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the running nodes listen and each one's metadata lists every running broker (they registered with
        the active controller, which needs a quorum)."""
        deadline = time.monotonic() + timeout_s
        running = {node_id for node_id, member in self.nodes.items() if member.running}
        for node_id in running:
            member = self.nodes[node_id]
            wait_for_port(HOST, member.node.port, max(1.0, deadline - time.monotonic()), member.process,
                          member.log_path)
        while True:
            brokers = asyncio.run(self._registered_brokers())
            if brokers >= running:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"brokers {sorted(brokers)} registered, {sorted(running)} expected")
            time.sleep(0.5)

    def kill(self, node_id: int) -> None:
        """SIGKILL one node: no controlled shutdown, whatever it had not answered stays unanswered."""
        self._signal(node_id, signal.SIGKILL)
        self._reap(node_id, 30)

    def stop(self, node_id: int, timeout_s: float = 60.0) -> None:
        """SIGTERM one node (a controlled shutdown, leadership moved first); SIGKILL if it outlives ``timeout_s``."""
        self._signal(node_id, signal.SIGTERM)
        if not self._reap(node_id, timeout_s):
            self.kill(node_id)

    def restart(self, node_id: int, timeout_s: float = 120.0) -> None:
        """Start a node again on its data dir (after kill or stop) and wait until it is registered again."""
        if self.nodes[node_id].running:
            self.stop(node_id)
        self._launch(node_id)
        self.wait_ready(timeout_s)

    def pause(self, node_id: int) -> None:
        """SIGSTOP: the node holds its sockets open and answers nothing."""
        self._signal(node_id, signal.SIGSTOP)

    def resume(self, node_id: int) -> None:
        self._signal(node_id, signal.SIGCONT)

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every node still running at once (resumed first, so a paused one can shut down); SIGKILL what
        outlives ``timeout_s`` (one by one, stopping the three took 38 s of the test module's teardown)."""
        running = [node_id for node_id, member in self.nodes.items() if member.running]
        for node_id in running:
            self.resume(node_id)
            self._signal(node_id, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node_id in running:
            if not self._reap(node_id, max(0.1, deadline - time.monotonic())):
                self.kill(node_id)

    def leader_of(self, topic: str, partition: int) -> int:
        """The node id leading ``topic``'s ``partition`` now (-1 while it has none), from the cluster's metadata."""
        return self.partitions(topic)[partition][0]

    def partitions(self, topic: str) -> dict[int, tuple[int, list[int]]]:
        """partition -> (leader node id, in-sync replica node ids) for ``topic``, as the running nodes report it."""
        return asyncio.run(self._describe(topic))

    async def _describe(self, topic: str, timeout_s: float = 30.0) -> dict[int, tuple[int, list[int]]]:
        """Ask again while the admin client picks a node that just went away (its metadata still lists it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            admin = self._admin()
            try:
                await admin.start()
                described = await admin.describe_topics([topic])
                break
            except KafkaError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)
            finally:
                await admin.close()
        return {p["partition"]: (p["leader"], sorted(p["isr"])) for t in described for p in t["partitions"]}

    async def _registered_brokers(self) -> set[int]:
        admin = self._admin()
        try:
            await admin.start()
            cluster = await admin.describe_cluster()
        except Exception:  # not answering yet: no broker known
            return set()
        finally:
            await admin.close()
        return {broker["node_id"] for broker in cluster["brokers"]}

    def _admin(self) -> AIOKafkaAdminClient:
        running = ",".join(m.node.bootstrap for m in self.nodes.values() if m.running) or self.bootstrap_servers
        return AIOKafkaAdminClient(bootstrap_servers=running, request_timeout_ms=5000)

    def _launch(self, node_id: int) -> None:
        member = self.nodes[node_id]
        command = kafka_command(self.java, self.jars, member.properties, self.heap_mb)
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)

    def _signal(self, node_id: int, sig: signal.Signals) -> None:
        member = self.nodes[node_id]
        if member.running and member.process is not None:
            os.kill(member.process.pid, sig)

    def _reap(self, node_id: int, timeout_s: float) -> bool:
        process = self.nodes[node_id].process
        if process is None:
            return True
        try:
            process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
