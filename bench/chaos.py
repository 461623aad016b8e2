"""Chaos soak with a ledger: steady load while components are SIGKILLed or SIGSTOPped; is anything lost or stuck?

A private stack (durable tansu over its object store, ClickHouse on chdb) on free ports, and
every component as its own process: the dev model server (tiny model), the LLM proxy, a
streams worker, two trainers of one model (tiny, a checkpoint per step; one trains, the other
stands by to take over), hot swap, two runners driving
``agentstream.examples.arithmetic:solve`` through the proxy on tasks enqueued at a steady pace, and a direct
SpanPublisher process. Every ``--min-gap``..``--max-gap`` seconds a scheduler picks a component
kind (runner, proxy, stream worker, trainer, broker, ClickHouse; each kind once per round of
six, in a seeded order), SIGKILLs it and restarts it after a few seconds, or SIGSTOPs it and
SIGCONTs it later (a kind's first fault picks one at random, its next ones alternate, so every
kind meets both from its second fault on), then waits until that component is processing again.
A trainer fault hits the active trainer; its SIGKILL's recovery counts from the kill, since the
standby need not wait for the restart. ``--kinds`` narrows the faults to some kinds.

The producers write a ledger of what was acknowledged to them (``tests/support/span_ledger.py``). At
the end the load stops, the pipeline drains, and the ledger is checked against ClickHouse
(``FINAL``) and the trainer's manifests: acknowledged spans and rollouts missing, transitions
missing (expected from acknowledged rollouts, or on the transitions topic) and transitions
trained twice, plus components that did not answer or exit when asked. JSON lines as the other
benches; the exit status is 1 when the ledger does not balance or a process was stuck.

``--cluster`` runs it on a three-node Apache Kafka cluster instead of tansu (replication 3,
``min.insync.replicas`` 2, idempotent producers): a broker fault then hits one node, a SIGKILL
(restarted on its data) or a SIGSTOP held past the brokers' 9 s session with the controller, so
the controller fences it and its partitions move to the other two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from clickhouse_connect.driver.client import Client

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config, CreditRule, dump_toml, load_config
from agentstream.infra.kafka import client_options, topic_name
from agentstream.infra.processes import ServiceDirectory, free_port, wait_for_port
from agentstream.schemas import TASK, TRANSITION, TRANSITION_BATCH, AvroCodec, CodecError
from agentstream.schemas.transition_writer import transition_id
from agentstream.stack.control import BROKER, CLICKHOUSE, Stack
from agentstream.stack.machine import calibrate
from agentstream.trainer.standby import ModelLock
from bench.common import emit, percentile, private_environ
from tests.support.kafka_cluster import KafkaCluster
from tests.support.span_ledger import LedgerReader, LedgerState

BENCH = "chaos"
ROOT = Path(__file__).resolve().parents[1]
KINDS = ("runner", "proxy", "streams", "trainer", "broker", "clickhouse")
AGENT = "chaos-agent"
MODEL = "tiny"
TERMINAL = ("SUCCEEDED", "FAILED", "TIMED_OUT", "CANCELLED")
RECOVERY_TIMEOUT_S = 90.0


def say(message: str) -> None:
    print(f"chaos: [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- processes


class Child:
    """One component process of ours, its output appended to a log; signalled by PID only."""

    def __init__(self, name: str, kind: str, argv: list[str], env: dict[str, str], log: Path,
                 grace_s: float = 30.0) -> None:
        self.name, self.kind, self.argv, self.env, self.log, self.grace_s = name, kind, argv, env, log, grace_s
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.retired = False  # stopped on purpose at the end: not to be restarted

    def start(self) -> None:
        with open(self.log, "ab") as log:
            log.write(f"\n==== chaos: start {self.name} at {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self.process = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def exited(self) -> int | None:
        """The exit status when the process ended (reaping it), else None."""
        return None if self.process is None else self.process.poll()

    def signal(self, sig: signal.Signals) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def wait_gone(self, timeout_s: float) -> bool:
        if self.process is None:
            return True
        try:
            self.process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> tuple[bool, float]:
        """SIGCONT + SIGTERM, then SIGKILL after its grace + 15 s; (exited by itself in time, seconds taken)."""
        began = time.monotonic()
        self.retired = True
        if self.pid is None:
            return True, 0.0
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.wait_gone(self.grace_s + 15):
            return True, time.monotonic() - began
        self.signal(signal.SIGKILL)
        self.wait_gone(10)
        return False, time.monotonic() - began

    def tail(self, characters: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-characters:]
        except OSError:
            return ""


class Service:
    """The broker or ClickHouse of the private stack: found by its pidfile, restarted by ``Stack.up`` (as an operator
    would run ``agentstream up``)."""

    def __init__(self, name: str, kind: str, stack: Stack) -> None:
        self.name, self.kind, self.stack = name, kind, stack
        self.directory = ServiceDirectory(stack.home)

    @property
    def pid(self) -> int | None:
        record = self.directory.record(self.name)
        return record.pid if record is not None and record.alive() else None

    def signal(self, sig: signal.Signals) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            if sig == signal.SIGKILL:  # reap it if it is our child (Stack.up started it from this process)
                deadline = time.monotonic() + 10
                while self.directory.record(self.name).alive() and time.monotonic() < deadline:  # type: ignore[union-attr]
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
                    time.sleep(0.02)

    def start(self) -> None:
        self.stack.up(timeout_s=90, progress=lambda line: None)


class ClusterNode:
    """One node of the ``--cluster`` run's Apache Kafka cluster, faulted like a service: killed and restarted on its
    data, or paused and continued."""

    kind = "broker"
    PAUSE_S = (12.0, 20.0)
    """A paused node is held past ``broker.session.timeout.ms`` (9 s), so the controller fences it."""

    def __init__(self, cluster: KafkaCluster, node_id: int) -> None:
        self.cluster, self.node_id = cluster, node_id
        self.name = f"broker-{node_id}"

    @property
    def pid(self) -> int | None:
        member = self.cluster.nodes[self.node_id]
        return member.process.pid if member.running and member.process is not None else None

    def signal(self, sig: signal.Signals) -> None:
        if sig == signal.SIGKILL:
            self.cluster.kill(self.node_id)
        elif self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def start(self) -> None:
        self.cluster.restart(self.node_id)


# ---------------------------------------------------------------------------------------------- what we watch


class TopicWatcher(threading.Thread):
    """Reads the spans topic (when a record last arrived: the broker is serving) and every transition id on the
    transitions topic, from the beginning, reconnecting after broker restarts."""

    def __init__(self, config: Config, bootstrap: str) -> None:
        super().__init__(name="chaos-watcher", daemon=True)
        self.options = client_options(config.kafka, bootstrap)
        self.spans_topic = topic_name(config.topics, "spans")
        self.transitions_topic = topic_name(config.topics, "transitions")
        self.transitions: dict[str, str] = {}  # transition id -> model
        self.last_record_at = 0.0
        self.undecodable = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        from aiokafka import AIOKafkaConsumer

        codec = AvroCodec()
        while not self.stopping.is_set():
            consumer = AIOKafkaConsumer(self.spans_topic, self.transitions_topic, **self.options,
                                        auto_offset_reset="earliest", enable_auto_commit=False,
                                        request_timeout_ms=10_000, fetch_max_wait_ms=200)
            try:
                await asyncio.wait_for(consumer.start(), 20)
                while not self.stopping.is_set():
                    batch = await asyncio.wait_for(consumer.getmany(timeout_ms=300), 30)
                    for tp, records in batch.items():
                        if records:
                            self.last_record_at = time.time()
                        if tp.topic != self.transitions_topic:
                            continue
                        for record in records:
                            self._transitions(codec, record.value)
            except Exception:  # the broker is away (killed or stopped): start over once it answers
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(consumer.stop(), 10)

    def _transitions(self, codec: AvroCodec, value: bytes | None) -> None:
        try:
            name, decoded = codec.decode(value or b"")
        except CodecError:
            self.undecodable += 1
            return
        items = decoded["transitions"] if name == TRANSITION_BATCH else [decoded] if name == TRANSITION else []
        for item in items:
            self.transitions[item["transition_id"]] = item["model"]


class Warehouse:
    """ClickHouse as the harness reads it; every call survives ClickHouse being away (None)."""

    def __init__(self, config: Config, url: str) -> None:
        self.config, self.url = config, url
        self.client: Client | None = None

    def query(self, sql: str) -> list | None:
        try:
            if self.client is None:
                self.client = connect(self.config.clickhouse, self.url, database=self.config.clickhouse.database,
                                      timeout_s=10)
            return list(self.client.query(sql).result_rows)
        except Exception:
            with contextlib.suppress(Exception):
                if self.client is not None:
                    self.client.close()
            self.client = None
            return None

    def newest_ingest(self) -> float:
        rows = self.query("SELECT toUnixTimestamp64Milli(max(ingested_at)) FROM spans")
        return rows[0][0] / 1000 if rows and rows[0][0] else 0.0


class Lineage:
    """Every checkpoint manifest the trainers published, each remembered once read: pruning may remove it later."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: dict[Path, dict] = {}

    def poll(self) -> list[dict]:
        """Read the manifests published since the last poll (staging folders come and go meanwhile); all seen."""
        models: list[Path] = []
        with contextlib.suppress(OSError):
            models = [path for path in self.folder.iterdir() if not path.name.startswith(".")]
        for model in models:
            paths: list[Path] = []
            with contextlib.suppress(OSError):
                paths = sorted(model.glob("v*/checkpoint.json"))
            for path in paths:
                if path not in self.seen:
                    with contextlib.suppress(OSError, ValueError):
                        self.seen[path] = json.loads(path.read_text())
        return list(self.seen.values())


# ---------------------------------------------------------------------------------------------- the load


class TaskFeeder(threading.Thread):
    """Enqueues arithmetic tasks for the runners at a steady pace; while the broker is away it retries."""

    def __init__(self, config: Config, bootstrap: str, per_s: float, seed: int) -> None:
        super().__init__(name="chaos-tasks", daemon=True)
        self.config, self.bootstrap, self.per_s = config, bootstrap, per_s
        self.rng = random.Random(seed)
        self.enqueued = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        from aiokafka import AIOKafkaProducer

        from agentstream.examples.arithmetic import split
        from agentstream.pipeline.runner.tasks import grouped_tasks

        payloads, _ = split()
        codec = AvroCodec()
        topic = topic_name(self.config.topics, "tasks")
        begin, due = time.monotonic(), 0
        while not self.stopping.is_set():
            producer = AIOKafkaProducer(**client_options(self.config.kafka, self.bootstrap), acks="all",
                                        request_timeout_ms=10_000)
            try:
                await asyncio.wait_for(producer.start(), 20)
                while not self.stopping.is_set():
                    await asyncio.sleep(0.5)
                    wanted = int((time.monotonic() - begin) * self.per_s) - due
                    if wanted <= 0:
                        continue
                    wanted = min(wanted, int(5 * self.per_s) + 1)  # after an outage: no flood of stale tasks
                    tasks = grouped_tasks([self.rng.choice(payloads) for _ in range(wanted)], agent_name=AGENT,
                                          max_attempts=2, timeout_s=60.0)
                    deliveries = [await producer.send(topic, key=task["rollout_id"].encode(),
                                                      value=codec.encode(TASK, task)) for task in tasks]
                    await asyncio.wait_for(asyncio.gather(*deliveries), 30)
                    self.enqueued += len(tasks)
                    due = int((time.monotonic() - begin) * self.per_s)
            except Exception:
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(producer.stop(), 10)


# ---------------------------------------------------------------------------------------------- the soak


@dataclass
class Fault:
    number: int
    kind: str
    target: str
    mode: str  # KILL or STOP
    injected_at: float
    held_s: float
    restarted_at: float = 0.0
    recovered_at: float | None = None
    standby: bool = False  # a standby could take over at once: recovery counts from the fault, not the restart

    @property
    def counted_from(self) -> float:
        return self.injected_at if self.standby else self.restarted_at

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.counted_from


class ChaosRun:
    """The private stack, its components as processes, the load, the faults and the verdict of one run."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.ledger_dir = workdir / "ledger"
        self.ledgered: list[str] = []  # the producers that write a ledger (its file's stem)
        self.logs = workdir / "logs"
        self.work_home = workdir / "home"
        self.checkpoints = workdir / "checkpoints"
        for folder in (self.ledger_dir, self.logs, self.work_home, self.checkpoints):
            folder.mkdir(parents=True)
        self.cluster = KafkaCluster(workdir / "kafka") if args.cluster else None
        cluster = ({"KAFKA_BOOTSTRAP_SERVERS": self.cluster.bootstrap_servers,
                    "AGENTSTREAM_TOPIC_REPLICATION_FACTOR": "3"} if self.cluster is not None else {})
        retention = {"AGENTSTREAM_TOPIC_RETENTION_MS": str(args.retention_ms)} if args.retention_ms else {}
        self.config = load_config(environ=private_environ(
            str(workdir / "stack"), AGENTSTREAM_BROKER=args.broker, AGENTSTREAM_BROKER_STORAGE=args.broker_storage,
            **retention, **cluster))
        self.stack = Stack(self.config)
        self.children: dict[str, Child] = {}
        self.services: dict[str, Service | ClusterNode] = {}
        self.faults: list[Fault] = []
        self.stopped: str | None = None  # the component SIGSTOPped right now
        self.last_mode: dict[str, str] = {}  # kind -> KILL or STOP, its latest fault
        self.unplanned: list[str] = []
        self.stuck: list[str] = []
        self.reader = LedgerReader(self.ledger_dir)
        self.lineage = Lineage(self.checkpoints)
        self.watcher: TopicWatcher | None = None
        self.feeder: TaskFeeder | None = None
        self.warehouse: Warehouse | None = None
        self.newest_ingest = 0.0
        self.server_url = f"http://127.0.0.1:{free_port()}"
        self.proxy_url = f"http://127.0.0.1:{free_port()}"

    # --- start and stop ------------------------------------------------------------------------

    def component_config(self) -> Config:
        trainer = replace(self.config.trainer, model=MODEL, device="cpu", threads=1, lora=False, batch_wait_s=2.0,
                          batch_transitions=32, max_policy_lag=1_000_000, skip_zero_advantage=False,
                          checkpoint_every_steps=1, keep_checkpoints=self.args.keep_checkpoints,
                          checkpoint_dir=str(self.checkpoints))
        return replace(self.config, stack=replace(self.config.stack, home=self.work_home), trainer=trainer,
                       credit=(CreditRule(agent="*", strategy="final"),))

    @property
    def broker_name(self) -> str:
        if self.cluster is not None:
            return "kafka-cluster-3"
        return "kafka" if self.args.broker == "kafka" else f"tansu-{self.args.broker_storage}"

    def start(self) -> None:
        if self.cluster is not None:
            say(f"three-node Apache Kafka cluster in {self.workdir / 'kafka'}, then a private stack beside it")
            self.cluster.start()
        else:
            say(f"private stack ({self.broker_name} broker) in {self.workdir}")
        endpoints = self.stack.up(timeout_s=90, progress=lambda line: None)
        self.bootstrap, self.clickhouse_url = endpoints.bootstrap_servers, endpoints.clickhouse_url
        self.services = {"clickhouse": Service(CLICKHOUSE, "clickhouse", self.stack)}
        if self.cluster is None:
            self.services["broker"] = Service(BROKER, "broker", self.stack)
        else:
            self.services.update({f"broker-{n}": ClusterNode(self.cluster, n) for n in self.cluster.nodes})
        config_path = self.workdir / "agentstream.toml"
        config_path.write_text(dump_toml(self.component_config()))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
        env.update(AGENTSTREAM_CONFIG=str(config_path), KAFKA_BOOTSTRAP_SERVERS=self.bootstrap,
                   CLICKHOUSE_URL=self.clickhouse_url, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
                   PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        python = sys.executable

        def add(name: str, kind: str, argv: list[str], grace_s: float = 30.0) -> Child:
            child = self.children[name] = Child(name, kind, argv, env, self.logs / f"{name}.log", grace_s)
            return child

        def ledgered(name: str, *command: str) -> list[str]:
            self.ledgered.append(name)
            return [python, "-m", "bench.chaos_ledger", "--ledger", str(self.ledger_dir / f"{name}.ledger"), "--",
                    *command]

        server_port, proxy_port = self.server_url.rsplit(":", 1)[1], self.proxy_url.rsplit(":", 1)[1]
        add("model-server", "model-server", [python, "-m", "agentstream", "serve-model", "--model", MODEL, "--port",
                                             server_port, "--threads", "1", "--max-tokens", "32"], 15)
        add("proxy", "proxy", ledgered("proxy", "proxy", "--upstream", self.server_url, "--port", proxy_port), 15)
        for number in range(self.args.stream_workers):
            add(f"streams-{number}", "streams", [python, "-m", "agentstream", "streams", "--loglevel", "info"],
                self.config.streams.shutdown_grace_s)
        for number in range(self.args.trainers):  # the first to take the model's lock trains, the others stand by
            add(f"trainer-{number}", "trainer", [python, "-m", "agentstream", "train-worker"],
                self.config.trainer.shutdown_grace_s)
        add("hotswap", "hotswap", [python, "-m", "agentstream", "hotswap", "--server", self.server_url, "--model",
                                   MODEL], 15)
        for number in range(self.args.runners):
            add(f"runner-{number}", "runner", ledgered(f"runner-{number}", "run",
                                                      "agentstream.examples.arithmetic:solve",
                                                      "--proxy", self.proxy_url, "--concurrency",
                                                      str(self.args.concurrency)), self.config.runner.shutdown_grace_s)
        self.ledgered.append("publisher")
        add("publisher", "runner", [python, "-m", "bench.chaos_ledger", "--ledger",
                                    str(self.ledger_dir / "publisher.ledger"), "publish", "--journal",
                                    str(self.work_home / "journal" / "direct"), "--rollouts-per-s",
                                    str(self.args.direct_rollouts_per_s), "--seed", str(self.args.seed)], 15)
        for name in ("model-server", *(n for n in self.children if n.startswith(("streams", "trainer"))), "hotswap"):
            self.children[name].start()
        self.wait_http(self.server_url + "/health", "model-server", 180)
        self.children["proxy"].start()
        self.wait_http(self.proxy_url + "/health", "proxy", 60)
        deadline = time.monotonic() + 120
        for name in (n for n in self.children if n.startswith("streams")):
            while b"Worker]: Ready" not in self.children[name].log.read_bytes():
                if self.children[name].exited() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start:\n{self.children[name].tail()}")
                time.sleep(0.3)
        self.warehouse = Warehouse(self.config, self.clickhouse_url)
        self.watcher = TopicWatcher(self.config, self.bootstrap)
        self.watcher.start()
        self.feeder = TaskFeeder(self.config, self.bootstrap, self.args.tasks_per_s, self.args.seed)
        self.feeder.start()
        for name in (n for n in self.children if self.children[n].kind == "runner"):
            self.children[name].start()
        say(f"components up: model server {self.server_url}, proxy {self.proxy_url}, "
            f"{self.args.stream_workers} streams worker(s), trainer, hot swap, {self.args.runners} runners, "
            "direct publisher; logs in " + str(self.logs))

    def wait_http(self, url: str, name: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            child = self.children.get(name)
            if child is not None and child.exited() is not None:
                raise RuntimeError(f"{name} exited:\n{child.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return True
            except OSError:
                time.sleep(0.3)
        return False

    def shutdown(self) -> None:
        """Stop everything we started, by PID (also on errors and Ctrl-C)."""
        for thread in (self.feeder, self.watcher):
            if thread is not None:
                thread.stopping.set()
        for child in self.children.values():
            child.signal(signal.SIGCONT)
        for service in self.services.values():
            service.signal(signal.SIGCONT)
        for child in self.children.values():
            if child.pid is not None:
                child.signal(signal.SIGTERM)
        deadline = time.monotonic() + 45
        for child in self.children.values():
            if not child.wait_gone(max(0.1, deadline - time.monotonic())):
                child.signal(signal.SIGKILL)
                child.wait_gone(10)
        if self.warehouse is not None and self.warehouse.client is not None:
            with contextlib.suppress(Exception):
                self.warehouse.client.close()
        with contextlib.suppress(Exception):
            self.stack.down(progress=lambda line: None)
        if self.cluster is not None:
            self.cluster.stop_all()
        for thread in (self.feeder, self.watcher):
            if thread is not None:
                thread.join(15)

    # --- faults --------------------------------------------------------------------------------

    def active_trainer(self) -> str:
        """The pid of the trainer that holds the model's lock (the one that trains), or '?'."""
        return ModelLock(self.work_home, MODEL).holder()

    def targets(self, kind: str) -> list[Child | Service | ClusterNode]:
        if kind == "trainer":  # the one that trains: a standby's fault changes nothing
            active = self.active_trainer()
            found = [child for child in self.children.values() if child.kind == kind and str(child.pid) == active]
            if found:
                return list(found)
        return ([service for service in self.services.values() if service.kind == kind]
                + [child for child in self.children.values() if child.kind == kind])

    def activity(self, fault: Fault) -> float:
        """When the fault's component last showed it was processing (time.time())."""
        state = self.reader.state
        if fault.kind in ("runner", "proxy"):
            return state.last_round.get(fault.target, 0.0)
        if fault.kind in ("streams", "clickhouse"):
            return self.newest_ingest
        if fault.kind == "trainer":
            return max((m["created_at_us"] / 1e6 for m in self.lineage.poll()), default=0.0)
        return self.watcher.last_record_at if self.watcher is not None else 0.0

    def inject(self, number: int, kind: str) -> Fault:
        target = self.rng.choice(self.targets(kind))
        previous = self.last_mode.get(kind)
        mode = self.rng.choice(("KILL", "STOP")) if previous is None else "STOP" if previous == "KILL" else "KILL"
        self.last_mode[kind] = mode
        held = (self.rng.uniform(1, 5) if mode == "KILL" else self.rng.uniform(*ClusterNode.PAUSE_S)
                if isinstance(target, ClusterNode) else self.rng.uniform(3, 15))
        standby = mode == "KILL" and kind == "trainer" and self.args.trainers > 1
        fault = Fault(number, kind, target.name, mode, time.time(), held, standby=standby)
        pid = target.pid
        target.signal(signal.SIGKILL if mode == "KILL" else signal.SIGSTOP)
        self.stopped = target.name if mode == "STOP" else None
        if isinstance(target, Child) and mode == "KILL":
            target.wait_gone(10)
        say(f"fault {number}: {'SIGKILL' if mode == 'KILL' else 'SIGSTOP'} {target.name} (pid {pid}), "
            f"{'restart' if mode == 'KILL' else 'SIGCONT'} in {held:.1f} s")
        self.idle(held)
        if mode == "KILL":
            target.start()
            say(f"fault {number}: {target.name} restarted (pid {target.pid})")
        else:
            target.signal(signal.SIGCONT)
            self.stopped = None
            say(f"fault {number}: {target.name} continued")
        fault.restarted_at = time.time()
        self.faults.append(fault)
        return fault

    def idle(self, seconds: float) -> None:
        """Watch the run for ``seconds``: read the ledger, ClickHouse's newest ingest, restart what exited by itself."""
        end = time.monotonic() + seconds
        while True:
            self.reader.poll()
            self.lineage.poll()
            if self.warehouse is not None and self.stopped != "clickhouse":  # a stopped ClickHouse would hold us
                self.newest_ingest = max(self.newest_ingest, self.warehouse.newest_ingest())
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(1.0, left))

    def restart_exited(self, faulted: str | None = None) -> None:
        for child in self.children.values():
            status = child.exited()
            if status is not None and child.name != faulted and not child.retired:
                self.unplanned.append(f"{child.name} exited with {status}")
                say(f"{child.name} exited by itself with status {status}; restarting it. Its log ends:\n"
                    + child.tail(600))
                child.start()
        for service in self.services.values():
            if service.pid is None and service.name != faulted:
                self.unplanned.append(f"{service.name} was not running")
                say(f"{service.name} is not running; starting it again")
                service.start()

    def run_faults(self) -> None:
        begin = time.time()
        end = begin + self.args.seconds
        bag: list[str] = []
        next_at = begin + self.rng.uniform(self.args.min_gap, self.args.max_gap)
        last_report = begin
        while time.time() < end:
            self.idle(1.0)
            self.restart_exited()
            now = time.time()
            if now - last_report >= 30:
                last_report = now
                state = self.reader.state
                say(f"{now - begin:4.0f} s: {len(state.spans)} spans and "
                    f"{sum(1 for e in state.events.values() if any(x[1] in TERMINAL for x in e))} rollouts "
                    f"acknowledged, {self.feeder.enqueued if self.feeder else 0} tasks enqueued, "
                    f"{len(self.watcher.transitions) if self.watcher else 0} transitions on the topic, "
                    f"{len(self.lineage.poll())} checkpoints")
            if now < next_at or next_at >= end:
                continue
            if not bag:
                bag = list(self.args.kinds)
                self.rng.shuffle(bag)
            fault = self.inject(len(self.faults) + 1, bag.pop())
            while time.time() - fault.restarted_at < RECOVERY_TIMEOUT_S:
                self.idle(0.5)
                if self.activity(fault) > fault.counted_from:
                    fault.recovered_at = self.activity(fault)
                    break
                self.restart_exited(faulted=None)
            if fault.recovery_s is None:
                say(f"fault {fault.number}: {fault.target} NOT processing {RECOVERY_TIMEOUT_S:.0f} s after restart")
            else:
                since = "the fault (a standby took over)" if fault.standby else (
                    "restart" if fault.mode == "KILL" else "SIGCONT")
                say(f"fault {fault.number}: {fault.target} processing again {fault.recovery_s:.1f} s after {since}")
            next_at = fault.injected_at + self.rng.uniform(self.args.min_gap, self.args.max_gap)

    # --- the end -------------------------------------------------------------------------------

    def answers(self) -> list[str]:
        """Components that do not answer now (each in its own way)."""
        silent = []
        for name, url in (("model-server", self.server_url + "/health"), ("proxy", self.proxy_url + "/health")):
            try:
                with urllib.request.urlopen(url, timeout=10):
                    pass
            except OSError:
                silent.append(name)
        if self.warehouse is None or self.warehouse.query("SELECT 1") is None:
            silent.append("clickhouse")
        for address in self.bootstrap.split(","):  # one broker, or each node of the cluster
            try:
                host, port = address.rsplit(":", 1)
                wait_for_port(host, int(port), 10)
            except Exception:
                silent.append(f"broker {address}")
        silent += [child.name for child in self.children.values() if child.exited() is not None]
        return silent

    def stop_component(self, name: str) -> None:
        child = self.children[name]
        alone, seconds = child.stop()
        if not alone:
            self.stuck.append(f"{name} (no exit within {child.grace_s + 15:.0f} s of SIGTERM)")
            say(f"{name} did NOT exit within {child.grace_s + 15:.0f} s of SIGTERM: killed. Its log ends:\n"
                + child.tail(800))
        else:
            say(f"{name} exited {seconds:.1f} s after SIGTERM (status {child.exited()})")

    def finish(self) -> int:
        for service in self.services.values():  # a fault may have been cut short by the clock: nothing stays stopped
            service.signal(signal.SIGCONT)
        for child in self.children.values():
            child.signal(signal.SIGCONT)
        self.restart_exited()
        silent = self.answers()
        self.stuck += [f"{name} (did not answer at the end)" for name in silent]
        say("load stops: the task feeder, then the direct publisher and the runners (SIGTERM), then the proxy")
        if self.feeder is not None:
            self.feeder.stopping.set()
        for name in [n for n in self.children if self.children[n].kind == "runner"]:
            self.children[name].signal(signal.SIGTERM)
        for name in [n for n in self.children if self.children[n].kind == "runner"]:
            self.stop_component(name)
        self.stop_component("proxy")
        verdict = self.drain()
        active = self.active_trainer()
        trainers = sorted((name for name, child in self.children.items() if child.kind == "trainer"),
                          key=lambda name: str(self.children[name].pid) == active)  # standbys first: none takes over
        for name in (*trainers, "hotswap", *(n for n in self.children if n.startswith("streams")), "model-server"):
            self.stop_component(name)
        return self.report(verdict)

    def verdict(self) -> dict:
        """The ledger against ClickHouse (FINAL), the transitions topic and the trainer's manifests."""
        assert self.warehouse is not None and self.watcher is not None
        state = self.reader.poll()
        spans_rows = self.warehouse.query("SELECT span_id FROM spans FINAL")
        rollout_rows = self.warehouse.query("SELECT rollout_id, status FROM rollouts FINAL")
        transition_rows = self.warehouse.query("SELECT transition_id, model FROM transitions FINAL")
        if spans_rows is None or rollout_rows is None or transition_rows is None:
            return {"complete": False, "error": "ClickHouse did not answer"}
        stored_spans = {row[0] for row in spans_rows}
        stored_rollouts = {row[0]: row[1] for row in rollout_rows}
        stored_transitions = {row[0]: row[1] for row in transition_rows}

        lost_spans = [span for span in state.spans if span not in stored_spans]
        acked_rollouts = {rid for rid, events in state.events.items() if any(e[1] in TERMINAL for e in events)}
        lost_rollouts = [rid for rid in acked_rollouts if rid not in stored_rollouts]

        # Transitions each acknowledged rollout must make: one per LLM call with token ids of its only attempt,
        # when that attempt SUCCEEDED and every call of it was acknowledged (direct rollouts: all 15).
        calls: dict[tuple[str, str], list[str]] = defaultdict(list)
        for span_id, (_, rollout, attempt, kind, _, tokens, _) in state.spans.items():
            if kind == "LLM" and tokens:
                calls[(rollout, attempt)].append(span_id)
        expected: dict[str, str] = {}
        for rid in acked_rollouts:
            attempts = {e[0] for e in state.events[rid]}
            if len(attempts) != 1 or not any(e[1] == "SUCCEEDED" for e in state.events[rid]):
                continue
            attempt = attempts.pop()
            mine = calls.get((rid, attempt), [])
            if state.producer_of_rollout.get(rid) == "publisher" and len(mine) != 15:
                continue
            for span_id in mine:
                expected[transition_id(rid, attempt, span_id)] = rid
        missing_expected = [tid for tid in expected if tid not in stored_transitions]
        on_topic = self.watcher.transitions.copy()  # the watcher thread adds to it
        missing_topic = [tid for tid in on_topic if tid not in stored_transitions]

        trained: Counter[str] = Counter()
        for manifest in self.lineage.poll():
            if manifest.get("model") == MODEL:
                trained.update(manifest.get("trained_ids", []))
        for_trainer = {tid for tid, model in stored_transitions.items() if model == MODEL}
        for_trainer |= {tid for tid, model in on_topic.items() if model == MODEL}
        untrained = [tid for tid in for_trainer if tid not in trained]
        twice = [tid for tid, count in trained.items() if count > 1]
        lost_transitions = set(missing_expected) | set(missing_topic) | set(untrained)
        return {"complete": not (lost_spans or lost_rollouts or lost_transitions), "state": state,
                "lost_spans": lost_spans, "lost_rollouts": lost_rollouts, "missing_expected": missing_expected,
                "missing_topic": missing_topic, "untrained": untrained, "twice": twice,
                "lost_transitions": lost_transitions, "expected": len(expected), "for_trainer": len(for_trainer),
                "trained": sum(trained.values()), "stored_spans": len(stored_spans),
                "acked_rollouts": len(acked_rollouts), "stored_transitions": len(stored_transitions)}

    def drain(self) -> dict:
        say(f"draining: waiting up to {self.args.drain_s:.0f} s for every acknowledged span, rollout and transition "
            "to be stored and trained")
        deadline = time.monotonic() + self.args.drain_s
        verdict: dict = {"complete": False}
        while time.monotonic() < deadline:
            self.restart_exited()
            verdict = self.verdict()
            if verdict["complete"]:
                self.idle(5)  # transitions the last rollouts make may still be on their way to the topic
                verdict = self.verdict()
                if verdict["complete"]:
                    break
            if "lost_spans" in verdict:
                say(f"draining: {len(verdict['lost_spans'])} spans, {len(verdict['lost_rollouts'])} rollouts, "
                    f"{len(verdict['lost_transitions'])} transitions not there yet "
                    f"({len(verdict['untrained'])} not trained)")
            self.idle(5)
        return verdict

    def report(self, verdict: dict) -> int:
        if "lost_spans" not in verdict:
            say(f"no verdict: {verdict.get('error')}")
            emit(BENCH, "chaos_spans_lost", None, "spans", error=verdict.get("error"))
            return 1
        state: LedgerState = verdict["state"]
        by_kind = Counter(f.kind for f in self.faults)
        by_mode = Counter(f"{f.kind}:{f.mode}" for f in self.faults)
        extra = {"seconds": self.args.seconds, "seed": self.args.seed, "broker": self.broker_name}
        emit(BENCH, "chaos_faults", len(self.faults), "faults", kinds_covered=len(by_kind), **extra)
        emit(BENCH, "chaos_faults_by_kind", len(by_kind), "kinds", by_kind=dict(sorted(by_kind.items())),
             by_kind_and_mode=dict(sorted(by_mode.items())), **extra)
        producers = Counter(entry[0] for entry in state.spans.values())
        silent = sorted(name for name in self.ledgered if not producers[name])
        emit(BENCH, "chaos_spans_acknowledged", len(state.spans), "spans", by_producer=dict(sorted(producers.items())),
             rollouts_acknowledged=verdict["acked_rollouts"], publisher_records_dropped=sum(state.dropped.values()),
             producers_without_spans=silent, **extra)
        if silent:
            say(f"no acknowledged span in the ledger of {', '.join(silent)}: their spans were not checked (is the "
                f"ledgered publisher installed where that process builds its publisher?)")
        emit(BENCH, "chaos_spans_lost", len(verdict["lost_spans"]), "spans",
             by_producer=dict(Counter(state.spans[s][0] for s in verdict["lost_spans"])),
             by_fault=self.blame([state.spans[s][6] for s in verdict["lost_spans"]]),
             rollouts_lost=len(verdict["lost_rollouts"]), examples=verdict["lost_spans"][:5], **extra)
        emit(BENCH, "chaos_rollouts_lost", len(verdict["lost_rollouts"]), "rollouts",
             examples=verdict["lost_rollouts"][:5], **extra)
        emit(BENCH, "chaos_transitions_lost", len(verdict["lost_transitions"]), "transitions",
             expected_from_ledger=verdict["expected"], missing_expected=len(verdict["missing_expected"]),
             on_topic=len(self.watcher.transitions) if self.watcher else 0,
             on_topic_not_stored=len(verdict["missing_topic"]), for_trainer=verdict["for_trainer"],
             not_trained=len(verdict["untrained"]), stored=verdict["stored_transitions"],
             examples=sorted(verdict["lost_transitions"])[:5], **extra)
        emit(BENCH, "chaos_transitions_trained_twice", len(verdict["twice"]), "transitions",
             trained=verdict["trained"], checkpoints=len(self.lineage.poll()), examples=verdict["twice"][:5],
             **extra)
        recoveries = [f.recovery_s for f in self.faults if f.recovery_s is not None]
        unrecovered = [f"{f.number}:{f.target}" for f in self.faults if f.recovery_s is None]
        worst = {kind: round(max((f.recovery_s or RECOVERY_TIMEOUT_S) for f in self.faults if f.kind == kind), 2)
                 for kind in sorted(by_kind)}
        p99 = percentile([*recoveries, *([RECOVERY_TIMEOUT_S] * len(unrecovered))], 0.99) if self.faults else None
        emit(BENCH, "chaos_recovery_p99_s", p99, "s",
             p50=round(percentile(recoveries, 0.5), 2) if recoveries else None, max_by_kind=worst,
             unrecovered=unrecovered, **extra)
        emit(BENCH, "chaos_stuck_processes", len(self.stuck), "processes", which=self.stuck,
             unplanned_exits=self.unplanned, **extra)
        balanced = not (verdict["lost_spans"] or verdict["lost_rollouts"] or verdict["lost_transitions"]
                        or verdict["twice"])
        say("the ledger " + ("balances" if balanced else "does NOT balance")
            + (f"; {len(self.stuck)} process(es) stuck" if self.stuck else "; no process stuck"))
        return 0 if balanced and not self.stuck and not silent else 1

    def blame(self, times: list[float]) -> dict[str, int]:
        """Lost items by the last fault injected before they were acknowledged ("before faults" if none)."""
        blamed: Counter[str] = Counter()
        for at in times:
            fault = next((f for f in reversed(self.faults) if f.injected_at <= at), None)
            blamed[f"{fault.number}:{fault.target}:{fault.mode}" if fault else "before faults"] += 1
        return dict(blamed)


def arguments() -> argparse.ArgumentParser:
    """The run's options (``bench.soak`` parses its own list of them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600, help="Seconds of load with faults.")
    parser.add_argument("--seed", type=int, default=1, help="Seeds the fault schedule and the load.")
    parser.add_argument("--min-gap", type=float, default=20.0, help="Fewest seconds between two faults.")
    parser.add_argument("--max-gap", type=float, default=40.0, help="Most seconds between two faults (<= 60).")
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4, help="Rollouts at once per runner.")
    parser.add_argument("--tasks-per-s", type=float, default=3.0)
    parser.add_argument("--direct-rollouts-per-s", type=float, default=5.0, help="Direct rollouts of 16 spans.")
    parser.add_argument("--stream-workers", type=int, default=1)
    parser.add_argument("--trainers", type=int, default=2,
                        help="Trainer processes of the model: one trains, the others stand by to take over (>= 1).")
    parser.add_argument("--kinds", type=lambda text: tuple(text.split(",")), default=KINDS,
                        help=f"Comma-separated kinds of component to fault, in turn (default: {','.join(KINDS)}).")
    parser.add_argument("--drain-s", type=float, default=180.0, help="Most seconds to wait for the pipeline to drain.")
    parser.add_argument("--broker", choices=("tansu", "kafka"), default="tansu",
                        help="The private stack's broker: tansu (the stack's default) or one Apache Kafka node.")
    parser.add_argument("--broker-storage", choices=("durable", "memory"), default="durable",
                        help="tansu's storage (Apache Kafka always logs to disk).")
    parser.add_argument("--cluster", action="store_true",
                        help="A three-node Apache Kafka cluster (replication 3, min ISR 2) instead of tansu.")
    parser.add_argument("--keep-checkpoints", type=int, default=0,
                        help="trainer.keep_checkpoints (0: all; the ledger remembers every manifest it saw anyway).")
    parser.add_argument("--retention-ms", type=int, default=0, help="The topics' retention (0: the default, 7 days).")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder (logs, ledger, checkpoints).")
    return parser


def checked(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.trainers < 1:
        parser.error("--trainers: at least one")
    if unknown := sorted(set(args.kinds) - set(KINDS)):
        parser.error(f"--kinds: no such kind {', '.join(unknown)} (the kinds are {', '.join(KINDS)})")
    if args.cluster and args.broker != "tansu":
        parser.error("--cluster is a three-node Apache Kafka cluster already: leave out --broker")
    return args


def run(args: argparse.Namespace, harness: type[ChaosRun] = ChaosRun, prefix: str = "agentstream-chaos-") -> int:
    """One run in a fresh work folder: start, faults, finish; everything started is stopped, whatever happens."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    chaos = harness(args, workdir)

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    status = 1
    calibration = calibrate()  # before anything starts: what this machine does alone
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    try:
        chaos.start()
        chaos.run_faults()
        status = chaos.finish()
    except KeyboardInterrupt:
        say("interrupted: stopping everything")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        chaos.shutdown()
        if args.keep or status:
            say(f"logs, ledger and checkpoints kept in {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    return status


def main() -> None:
    sys.exit(run(checked(arguments())))


if __name__ == "__main__":
    main()
