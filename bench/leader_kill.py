"""Spans written twice by producer retries on the three-broker cluster, with and without the idempotent producer.

A three-node Apache Kafka cluster (tests/support/kafka_cluster.py: RF 3, min.insync.replicas 2) and, per run, a
fresh spans topic of 6 partitions that a ledgered SpanPublisher (tests/support/span_ledger.py) fills with rollouts at a
steady pace. Mid-load a fault: ``leader`` SIGKILLs the node leading the most spans partitions and restarts it
``--down-s`` later; ``two-down`` stops (SIGTERM) two nodes and restarts them. Then the load stops, the publisher
closes, and the topic is read back. Per run one JSON line: spans acknowledged (the ledger), acknowledged spans not on
the topic, span records beyond the first per span id on the topic, seconds from the fault until a span published
after it was acknowledged, and the idempotence setting (``[kafka] idempotence``, what the producers asked for).

    python -m bench.leader_kill --idempotence off --idempotence on --runs 3 --fault leader
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agentstream.infra.config import Config, load_config
from agentstream.infra.kafka import client_options, create_topics, topic_name
from bench.common import emit, private_environ
from tests.support.cluster_load import Load, beyond_first, busiest_leader, first_ack_after, ids_on_topic
from tests.support.kafka_cluster import KafkaCluster
from tests.support.span_ledger import LEDGER_ENV, LedgeredPublisher, LedgerReader

BENCH = "leader_kill"


@dataclass(frozen=True)
class RunResult:
    """What one run measured."""

    acked: int
    lost: int
    twice: int
    again_s: float | None
    stats: dict


def run_config(home: Path, cluster: KafkaCluster, idempotence: str, run: int) -> Config:
    """A config for one run: the cluster, a topic prefix of its own, RF 3 and 6 partitions, the idempotence asked."""
    return load_config(environ=private_environ(
        str(home), KAFKA_BOOTSTRAP_SERVERS=cluster.bootstrap_servers, KAFKA_IDEMPOTENCE=idempotence,
        AGENTSTREAM_TOPIC_PREFIX=f"lk{run}{idempotence}.", AGENTSTREAM_TOPIC_PARTITIONS="6",
        AGENTSTREAM_TOPIC_REPLICATION_FACTOR="3"))


def inject(cluster: KafkaCluster, fault: str, topic: str) -> list[int]:
    """Apply the fault; returns the nodes it took down."""
    if fault == "leader":
        victim = busiest_leader(cluster, topic)
        cluster.kill(victim)
        return [victim]
    down = [node for node in cluster.nodes if node != busiest_leader(cluster, topic)][:2]
    for node in down:
        cluster.stop(node)
    return down


def one_run(home: Path, cluster: KafkaCluster, args: argparse.Namespace, idempotence: str, run: int) -> RunResult:
    """Load, fault, recovery, read-back: acknowledged spans against the topic."""
    config = run_config(home / f"run{run}-{idempotence}", cluster, idempotence, run)
    asyncio.run(create_topics(config, cluster.bootstrap_servers))
    topic = topic_name(config.topics, "spans")
    ledger = home / f"run{run}-{idempotence}" / "ledger" / "publisher.ledger"
    ledger.parent.mkdir(parents=True)
    os.environ[LEDGER_ENV] = str(ledger)
    publisher = LedgeredPublisher(config, cluster.bootstrap_servers, journal_dir=ledger.parent.parent / "journal",
                                  request_timeout_ms=args.request_timeout_ms).start()
    load = Load(publisher, "bench", f"r{run}", per_s=args.rollouts_per_s)
    load.start()
    time.sleep(args.before_s)
    fault_at = time.time()
    down = inject(cluster, args.fault, topic)
    while time.time() < fault_at + args.down_s:
        stats = publisher.stats()
        print(f"leader_kill: {time.time() - fault_at:5.1f} s after the fault: {stats.state}, "
              f"{stats.spans_published} published, {stats.spans_journaled} journaled, "
              f"{stats.buffered_bytes} bytes buffered", file=sys.stderr, flush=True)
        time.sleep(1)
    for node in down:
        cluster.restart(node)
    time.sleep(args.after_s)
    after = load.first_after(fault_at)
    load.finish()
    publisher.close(60)
    state = LedgerReader(ledger.parent).poll()
    counts = ids_on_topic(client_options(config.kafka, cluster.bootstrap_servers), cluster, topic)
    acked_after = [at for _p, rollout, *_r, at in state.spans.values() if rollout >= after]
    return RunResult(acked=len(state.spans), lost=len(set(state.spans) - set(counts)), twice=beyond_first(counts),
                     again_s=first_ack_after(state.spans, after) - fault_at if acked_after else None,
                     stats=vars(publisher.stats()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idempotence", action="append", choices=("on", "off", "auto"),
                        help="repeat to compare (default: off, then on)")
    parser.add_argument("--fault", choices=("leader", "two-down"), default="leader")
    parser.add_argument("--runs", type=int, default=3, help="runs per idempotence setting, alternating")
    parser.add_argument("--rollouts-per-s", type=float, default=20.0, help="6 spans and 2 events each")
    parser.add_argument("--before-s", type=float, default=5.0)
    parser.add_argument("--down-s", type=float, default=15.0)
    parser.add_argument("--after-s", type=float, default=5.0)
    parser.add_argument("--request-timeout-ms", type=int, default=30_000)
    args = parser.parse_args()
    settings = args.idempotence or ["off", "on"]
    with tempfile.TemporaryDirectory(prefix="agentstream-leader-kill-") as folder:
        home = Path(folder)
        cluster = KafkaCluster(home / "cluster")
        try:
            cluster.start()
            for run in range(args.runs):
                for idempotence in settings:
                    result = one_run(home, cluster, args, idempotence, run)
                    emit(BENCH, "spans_twice_on_topic", result.twice, "records", idempotence=idempotence,
                         fault=args.fault, run=run, spans_acked=result.acked, spans_lost=result.lost,
                         acked_again_s=None if result.again_s is None else round(result.again_s, 2),
                         rollouts_per_s=args.rollouts_per_s, publisher=result.stats)
        finally:
            cluster.stop_all()


if __name__ == "__main__":
    main()
