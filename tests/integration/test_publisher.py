"""The span publisher against real brokers: delivery and order, bounded memory, broker outages, crashes, exit."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from agentstream.infra import kafka
from agentstream.infra.config import Config
from agentstream.infra.kafka import client_options, topic_name
from agentstream.infra.processes import free_port
from agentstream.pipeline.publisher import PublisherClosed, SpanPublisher
from agentstream.schemas import AvroCodec, EncodeError

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_732_200_000_000_000


def make_span(rollout_id: str, index: int, tokens: int = 100) -> dict[str, Any]:
    """An LLM span of about 1 KB whose span_id carries its index."""
    return {
        "span_id": f"span-{index:08d}", "rollout_id": rollout_id, "attempt_id": "a1", "name": "chat",
        "kind": "LLM", "start_time_us": T0 + index, "end_time_us": T0 + index + 1000, "status": "OK",
        "agent_name": "math-agent", "model": "SmolLM2-135M-Instruct",
        "attributes": {"gen_ai.system": "agentstream"},
        "prompt_token_ids": [(index * 7 + k) % 49152 for k in range(tokens)],
        "response_token_ids": [(index * 13 + k) % 49152 for k in range(tokens)],
        "response_logprobs": [-0.25] * tokens,
    }


def make_event(rollout_id: str) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "attempt_id": "a1", "event": "SUCCEEDED", "at_us": T0}


def index_of(span: dict[str, Any]) -> int:
    return int(span["span_id"].removeprefix("span-"))


@dataclass
class Landed:
    """Records of the spans topic in partition order: (partition, key, record name, value)."""

    records: list[tuple[int, bytes, str, dict]]

    @property
    def spans(self) -> list[dict]:
        return [span for _, _, name, value in self.records if name.endswith("SpanBatch") for span in value["spans"]]

    def span_counts(self) -> Counter[int]:
        return Counter(index_of(span) for span in self.spans)


def read_spans_topic(options: dict, topic: str, at_least: int, timeout_s: float = 30.0) -> Landed:
    """Read the topic from the beginning until `at_least` spans are in and one more poll brings nothing new."""

    async def read() -> Landed:
        codec = AvroCodec()
        consumer = AIOKafkaConsumer(topic, **options, enable_auto_commit=False, auto_offset_reset="earliest",
                                    max_partition_fetch_bytes=8 << 20, fetch_max_bytes=32 << 20)
        await consumer.start()
        landed = Landed([])
        spans = 0
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=700)
                if not batch and spans >= at_least:
                    break
                for tp, records in sorted(batch.items()):
                    for record in records:
                        name, value = codec.decode(record.value)
                        landed.records.append((tp.partition, record.key, name, value))
                        spans += len(value["spans"]) if name.endswith("SpanBatch") else 0
        finally:
            await consumer.stop()
        return landed

    return asyncio.run(read())


def arrivals(config: Config, bootstrap: str, first: int, end: int) -> dict[int, int]:
    """How many times each span from index ``first`` to ``end`` (excluded) landed on the config's spans topic."""
    counts = read_spans_topic(client_options(config.kafka, bootstrap), topic_name(config.topics, "spans"),
                              at_least=end - first).span_counts()
    return {index: counts[index] for index in range(first, end)}


def create_topics(config: Config, bootstrap: str) -> None:
    asyncio.run(kafka.create_topics(config, bootstrap))


@pytest.fixture
def spans_topic(topics_config: Config, stack) -> str:
    create_topics(topics_config, stack.bootstrap_servers)
    return topic_name(topics_config.topics, "spans")


def journal_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.journal"))


def outage_publisher(config: Config, bootstrap: str, journal_dir: Path, probe_interval_s: float = 0.2) -> SpanPublisher:
    """A started publisher on fresh topics that notices an outage within its 1.5 s request timeout."""
    create_topics(config, bootstrap)
    return SpanPublisher(config, bootstrap, journal_dir=journal_dir, linger_ms=5, request_timeout_ms=1500,
                         probe_interval_s=probe_interval_s).start()


# --- delivery ------------------------------------------------------------------------------------


def test_spans_arrive_once_grouped_per_rollout_in_order_with_events_after_them(
        topics_config, stack, kafka_options, spans_topic, tmp_path):
    rollouts = [f"ro-{n:02d}" for n in range(24)]
    published: dict[str, list[int]] = {rollout: [] for rollout in rollouts}
    with SpanPublisher(topics_config, stack.bootstrap_servers, journal_dir=tmp_path / "journal",
                       max_spans_per_record=40) as publisher:
        for index in range(4000):
            rollout = rollouts[(index * 7) % len(rollouts)]
            publisher.publish(make_span(rollout, index, tokens=20))
            published[rollout].append(index)
            if index % 1000 == 999:
                time.sleep(0.05)  # several waves, so order holds across them too
        for rollout in rollouts:
            publisher.publish_event(make_event(rollout))
        publisher.flush(30)
        stats = publisher.stats()
    assert (stats.spans_published, stats.events_published, stats.spans_journaled) == (4000, 24, 0)
    assert stats.buffered_bytes == 0

    landed = read_spans_topic(kafka_options, spans_topic, at_least=4000)
    assert landed.span_counts() == Counter(range(4000))
    partition_of: dict[str, int] = {}
    seen: dict[str, list[int]] = {rollout: [] for rollout in rollouts}
    ended: set[str] = set()
    for partition, key, name, value in landed.records:
        rollout = key.decode()
        assert partition_of.setdefault(rollout, partition) == partition, "one rollout, one partition"
        assert rollout not in ended, f"a record of {rollout} landed after its SUCCEEDED event"
        if name.endswith("RolloutEvent"):
            assert value["rollout_id"] == rollout
            ended.add(rollout)
        else:
            assert {span["rollout_id"] for span in value["spans"]} == {rollout}
            assert len(value["spans"]) <= 40
            seen[rollout] += [index_of(span) for span in value["spans"]]
    assert ended == set(rollouts)
    assert seen == published, "spans of a rollout land in the order they were published"


def test_publish_checks_spans_at_once_and_refuses_after_close(topics_config, stack, spans_topic, tmp_path):
    publisher = SpanPublisher(topics_config, stack.bootstrap_servers, journal_dir=tmp_path / "journal")
    with pytest.raises(PublisherClosed):
        publisher.publish(make_span("r", 0))
    with publisher:
        with pytest.raises(EncodeError, match="kind"):
            publisher.publish({**make_span("r", 1), "kind": "NOPE"})
        asyncio.run(publisher.publish_async(make_span("r", 2)))
        publisher.flush(10)
        assert publisher.stats().spans_published == 1
    with pytest.raises(PublisherClosed):
        publisher.publish(make_span("r", 3))
    assert publisher.stats().state == "closed"


# --- bounded memory -------------------------------------------------------------------------------


def test_publish_blocks_instead_of_growing_while_the_broker_stalls(topics_config, private_broker, tmp_path):
    create_topics(topics_config, private_broker.bootstrap)
    limit = 128 * 1024
    publisher = SpanPublisher(topics_config, private_broker.bootstrap, journal_dir=tmp_path / "journal",
                              max_buffered_bytes=limit, batch_bytes=32 * 1024, request_timeout_ms=20_000)
    with publisher:
        publisher.publish(make_span("warm", 0))
        publisher.flush(10)
        private_broker.process.send_signal(signal.SIGSTOP)  # connections stay open, nothing answers
        highest, longest = 0, 0.0

        def publish_many() -> None:
            nonlocal highest, longest
            for index in range(1, 1001):
                started = time.monotonic()
                publisher.publish(make_span(f"ro-{index % 5}", index))
                longest = max(longest, time.monotonic() - started)
                highest = max(highest, publisher.stats().buffered_bytes)

        thread = threading.Thread(target=publish_many)
        thread.start()
        time.sleep(1.5)
        assert thread.is_alive(), "publish() must block once the buffer is full"
        assert publisher.stats().buffered_bytes <= limit
        private_broker.process.send_signal(signal.SIGCONT)
        thread.join(30)
        publisher.flush(30)
        stats = publisher.stats()
    assert longest > 1.0 and highest <= limit
    assert (stats.spans_published, stats.spans_journaled) == (1001, 0)


# --- broker outage --------------------------------------------------------------------------------


def test_spans_published_during_an_outage_are_journaled_then_replayed_exactly_once(
        topics_config, private_broker, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="agentstream.pipeline.publisher")
    journal_dir = tmp_path / "journal"
    publisher = outage_publisher(topics_config, private_broker.bootstrap, journal_dir)
    published = 0
    stop = threading.Event()

    def publish_continuously() -> None:
        nonlocal published
        while not stop.is_set():
            for _ in range(40):
                publisher.publish(make_span(f"ro-{published % 8}", published, tokens=30))
                published += 1
            time.sleep(0.01)

    thread = threading.Thread(target=publish_continuously)
    thread.start()
    try:
        time.sleep(1.0)
        private_broker.kill()
        first_after_kill = published  # every span from here on was published with no broker alive
        deadline = time.monotonic() + 15
        while publisher.stats().spans_journaled == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert publisher.stats().state == "journaling"
        time.sleep(0.5)
        private_broker.start()  # same port, empty memory storage: the topic is gone too
        create_topics(topics_config, private_broker.bootstrap)
        deadline = time.monotonic() + 20
        while publisher.stats().state != "connected" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert publisher.stats().state == "connected"
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(30)
    publisher.close(30)
    stats = publisher.stats()

    assert stats.spans_journaled > 0 and stats.records_replayed > 0
    after_kill = arrivals(topics_config, private_broker.bootstrap, first_after_kill, published)
    assert set(after_kill.values()) == {1}, "every span published after the kill arrives exactly once"
    assert journal_files(journal_dir) == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "unreachable" in r.getMessage()]
    assert len(warnings) == 1 and str(journal_dir) in warnings[0].getMessage()
    assert any("replayed" in r.getMessage() for r in caplog.records)


def test_a_publisher_closing_just_after_the_broker_came_back_replays_its_journal_before_it_exits(
        topics_config, private_broker, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="agentstream.pipeline.publisher")
    journal_dir = tmp_path / "journal"
    # The probe would find the broker only after an hour: the close must ask it itself.
    publisher = outage_publisher(topics_config, private_broker.bootstrap, journal_dir, probe_interval_s=3600)
    private_broker.kill()
    for index in range(400):
        publisher.publish(make_span("ro-close", index, tokens=30))
    publisher.flush(30)
    assert (publisher.stats().state, publisher.stats().spans_journaled) == ("journaling", 400)
    private_broker.start()
    create_topics(topics_config, private_broker.bootstrap)

    started = time.monotonic()
    publisher.close(10)
    took = time.monotonic() - started

    assert took < 10, "the replay fits the close deadline"
    assert publisher.stats().spans_replayed == 400
    assert journal_files(journal_dir) == []
    assert set(arrivals(topics_config, private_broker.bootstrap, 0, 400).values()) == {1}
    assert any("is closing and the broker is back" in r.getMessage() for r in caplog.records)


def test_a_publisher_closing_while_the_broker_is_away_leaves_its_journal_within_the_close_deadline(
        topics_config, private_broker, tmp_path, caplog):
    journal_dir = tmp_path / "journal"
    publisher = outage_publisher(topics_config, private_broker.bootstrap, journal_dir)
    private_broker.process.send_signal(signal.SIGSTOP)  # its port still accepts connections; nothing answers
    try:
        for index in range(100):
            publisher.publish(make_span("ro-away", index, tokens=30))
        publisher.flush(30)
        started = time.monotonic()
        publisher.close(3)
        took = time.monotonic() - started
    finally:
        private_broker.process.send_signal(signal.SIGCONT)

    assert took < 3 + 2, "a broker that does not answer does not hold the close past its deadline"
    assert publisher.stats().spans_journaled == 100 and publisher.stats().spans_replayed == 0
    assert journal_files(journal_dir) != [], "left for the next publisher on that directory"


CRASHING_PUBLISHER = """
import json, os, signal, sys
from dataclasses import asdict
from pathlib import Path
from agentstream.infra.config import load_config
from agentstream.pipeline.publisher import SpanPublisher
from tests.integration.test_publisher import make_event, make_span

journal, prefix, bootstrap, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
config = load_config(environ={"AGENTSTREAM_TOPIC_PREFIX": prefix})
publisher = SpanPublisher(config, bootstrap, journal_dir=Path(journal)).start()
for index in range(count):
    publisher.publish(make_span(f"ro-{index % 3}", index))
publisher.publish_event(make_event("ro-0"))
publisher.flush(30)
print(json.dumps(asdict(publisher.stats())), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close, no atexit
"""


def test_a_journal_left_by_a_crashed_process_is_replayed_by_the_next_publisher(
        topics_config, stack, kafka_options, spans_topic, tmp_path, caplog):
    journal_dir = tmp_path / "journal"
    nobody = f"127.0.0.1:{free_port()}"
    child = subprocess.run([sys.executable, "-c", CRASHING_PUBLISHER, str(journal_dir), topics_config.topics.prefix,
                            nobody, "500"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert json.loads(child.stdout)["spans_journaled"] == 500
    assert "unreachable" in child.stderr
    (left,) = journal_files(journal_dir)
    with left.open("ab") as torn:  # the crash also cut a record short
        torn.write(b"\x40\x00\x00\x00\x01\x02")

    caplog.set_level(logging.INFO, logger="agentstream.pipeline.publisher")
    with SpanPublisher(topics_config, stack.bootstrap_servers, journal_dir=journal_dir) as publisher:
        deadline = time.monotonic() + 20
        while publisher.stats().state != "connected" and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = publisher.stats()
    assert (stats.spans_replayed, stats.records_replayed > 0) == (500, True)
    landed = read_spans_topic(kafka_options, spans_topic, at_least=500)
    assert landed.span_counts() == Counter(range(500))
    assert [name for _, key, name, _ in landed.records if key == b"ro-0"][-1].endswith("RolloutEvent")
    assert journal_files(journal_dir) == []
    assert any("cut short" in r.getMessage() for r in caplog.records)


EXITING_PUBLISHER = """
import sys, time
from pathlib import Path
from agentstream.infra.config import load_config
from agentstream.pipeline.publisher import SpanPublisher
from tests.integration.test_publisher import make_span

journal, prefix, bootstrap, how = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
config = load_config(environ={"AGENTSTREAM_TOPIC_PREFIX": prefix})
publisher = SpanPublisher(config, bootstrap, journal_dir=Path(journal), linger_ms=600_000).start()
for index in range(300):
    publisher.publish(make_span("ro-exit", index))
print("published", flush=True)
if how == "sigterm":
    time.sleep(60)  # killed before this ends
"""


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_spans_in_memory_are_flushed_on_sigterm_and_at_exit(
        topics_config, stack, kafka_options, spans_topic, tmp_path, how):
    child = subprocess.Popen([sys.executable, "-c", EXITING_PUBLISHER, str(tmp_path / "journal"),
                              topics_config.topics.prefix, stack.bootstrap_servers, how],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "published"
    if how == "sigterm":
        child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=30)
    assert child.returncode == (-signal.SIGTERM if how == "sigterm" else 0), stderr
    landed = read_spans_topic(kafka_options, spans_topic, at_least=300)
    assert landed.span_counts() == Counter(range(300))


# --- the journal ----------------------------------------------------------------------------------
