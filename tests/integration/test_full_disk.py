"""A full disk is back-pressure, never loss: the publisher's journal on a real filesystem that fills up.

The broker is killed, so the publisher journals; the journal's disk (a small tmpfs the test mounts) fills
up. Nothing acknowledged to a caller may be dropped: the records the disk refused stay held, publishers
block for room, the journal takes them when space comes back, and the broker takes everything when it is
back, each span exactly once. The proxy and the collector in front of such a publisher answer "retry later"
(503 with Retry-After) instead of blocking, and take work again by themselves once the disk has room.
The broker's own storage (tansu on the embedded object store) filling up is a broker that refuses
writes: the publisher journals, and everything arrives once the store has room.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time

import httpx
import pytest

from agentstream.infra.kafka import client_options, topic_name
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.models import load_model
from agentstream.pipeline.collector.http_front import OtlpHttp
from agentstream.pipeline.collector.receiver import OtlpReceiver
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.publisher.journal import Journal, Record
from agentstream.serving.app import create_app
from agentstream.stack.broker import BUCKET, find_tansu, s3_storage, tansu_command
from agentstream.stack.objectstore import ObjectStoreServer
from tests.integration.test_publisher import arrivals, create_topics, journal_files, make_span
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic
from tests.support.small_disk import SmallDisk

pytestmark = pytest.mark.integration


@pytest.fixture
def small_disk(tmp_path):
    disk = SmallDisk(tmp_path / "disk", 2 * 1024 * 1024)
    yield disk
    disk.unmount()


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_full_journal_disk_holds_and_blocks_then_loses_nothing(topics_config, private_broker, small_disk, caplog):
    caplog.set_level(logging.INFO, logger="agentstream.pipeline.publisher")
    create_topics(topics_config, private_broker.bootstrap)
    journal_dir = small_disk.path / "journal"
    publisher = SpanPublisher(topics_config, private_broker.bootstrap, journal_dir=journal_dir, linger_ms=5,
                              request_timeout_ms=1500, probe_interval_s=0.2, max_buffered_bytes=256 * 1024).start()
    published = 0
    stop = threading.Event()

    def publish_continuously() -> None:  # publish() returns: the span is the publisher's to deliver
        nonlocal published
        while not stop.is_set():
            publisher.publish(make_span(f"ro-{published % 8}", published, tokens=30))
            published += 1

    thread = threading.Thread(target=publish_continuously)
    try:
        small_disk.fill(leave_bytes=640 * 1024)  # room for a couple of journal chunks (256 KiB each), then none
        private_broker.kill()
        first_after_kill = published
        thread.start()
        wait_for(lambda: publisher.stats().journal_write_failures > 0, 15, "the full disk to refuse a journal write")
        time.sleep(1.0)  # what the buffer still had room for
        blocked_at = published
        time.sleep(1.5)  # publish() blocks for room: the held records keep the buffer full
        assert published - blocked_at < 100, "publishers kept going while nothing could take their spans"
        stats = publisher.stats()
        assert stats.records_dropped == 0 and stats.state == "journaling" and stats.buffered_bytes > 0
        assert stats.spans_journaled > 0

        small_disk.free()
        wait_for(lambda: published > blocked_at + 2000, 15, "publishing to resume once the disk has room")
        assert publisher.stats().spans_journaled > stats.spans_journaled

        private_broker.start()
        create_topics(topics_config, private_broker.bootstrap)
        wait_for(lambda: publisher.stats().state == "connected", 30, "the journal's replay")
    finally:
        stop.set()
        thread.join(60)
    publisher.close(30)
    stats = publisher.stats()
    assert stats.records_dropped == 0 and stats.journal_write_failures > 0
    arrived = arrivals(topics_config, private_broker.bootstrap, first_after_kill, published)
    assert set(arrived.values()) == {1}, "every span published, through the outage and the full disk, arrives once"
    assert journal_files(journal_dir) == []
    messages = [record.getMessage() for record in caplog.records]
    assert any("cannot journal" in message for message in messages)
    assert any("takes writes again" in message for message in messages)


def test_a_journal_append_the_disk_refuses_leaves_no_torn_record(small_disk):
    """A full disk writes part of a batch; what follows must still be readable, after the last whole record."""
    small_disk.fill(leave_bytes=64 * 1024)
    journal = Journal(small_disk.path / "journal", "spans")
    batch = [Record(f"ro-{n}".encode(), bytes([n % 251]) * 3000, spans=1) for n in range(8)]
    taken, refused = 0, None
    while refused is None:
        try:
            journal.append(batch)
            taken += len(batch)
        except OSError as error:
            refused = error
    assert taken > 0, "the disk took some batches before it was full"
    small_disk.free()
    journal.append(batch)
    taken += len(batch)
    read, _ = journal.read(1 << 30)
    assert [record.value for record in read] == [record.value for record in batch] * (taken // len(batch))
    journal.close()


def otlp_export(first: int, spans: int) -> dict:
    """An OTLP/JSON export of `spans` spans numbered from `first` (span id = the number in hex), 2 KB each."""
    return {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"spans": [
        {"traceId": f"{number:032x}", "spanId": f"{number:016x}", "name": "step", "kind": 1,
         "startTimeUnixNano": "1000", "endTimeUnixNano": "2000",
         "attributes": [{"key": "note", "value": {"stringValue": "x" * 2000}}]}
        for number in range(first, first + spans)]}]}]}


def test_the_proxy_and_the_collector_answer_retry_later_on_a_full_disk_and_lose_nothing(
        topics_config, private_broker, small_disk):
    create_topics(topics_config, private_broker.bootstrap)
    publisher = SpanPublisher(topics_config, private_broker.bootstrap, journal_dir=small_disk.path / "journal",
                              linger_ms=5, request_timeout_ms=1500, probe_interval_s=0.2,
                              max_buffered_bytes=256 * 1024).start()
    model_server = ServerThread(create_app(load_model("tiny")))
    proxy = ServerThread(LLMProxy(model_server.url, publisher).app)
    collector = ServerThread(OtlpHttp(OtlpReceiver(publisher)).app)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    exported: list[int] = []  # span numbers the collector acknowledged
    calls: list[str] = []  # rollouts whose call the proxy answered
    try:
        with httpx.Client(timeout=60) as client:
            def export() -> httpx.Response:
                first = len(exported) + 1
                answer = client.post(collector.url + "/v1/traces", json=otlp_export(first, 8))
                if answer.status_code == 200:
                    exported.extend(range(first, first + 8))
                return answer

            def call(rollout: str) -> httpx.Response:
                answer = client.post(f"{proxy.url}/rollouts/{rollout}/v1/chat/completions", json=chat)
                if answer.status_code == 200:
                    calls.append(rollout)
                return answer

            assert call("ro-warm").status_code == 200
            calls.clear()  # the broker keeps topics in memory: what it took before it dies is gone with it
            small_disk.fill(leave_bytes=64 * 1024)
            private_broker.kill()
            deadline = time.monotonic() + 60
            while (answer := export()).status_code == 200 or publisher.stats().journal_write_failures == 0:
                assert time.monotonic() < deadline, "the disk never filled up"  # the journal takes some, then none
                if answer.status_code == 503:
                    time.sleep(0.2)  # until the producer gives the broker up and the journal takes the buffer
            assert answer.status_code == 503 and answer.headers["Retry-After"] == "1", answer.text
            time.sleep(1.0)  # the held records are retried and refused again: the buffer stays full
            assert export().status_code == 503
            refused = call("ro-refused")
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
            assert refused.json()["error"]["message"]
            reward = client.post(f"{proxy.url}/rollouts/ro-rewarded/reward", json={"reward": 1.0})
            assert reward.status_code == 503 and reward.headers["Retry-After"] == "1", reward.text
            assert client.get(proxy.url + "/health").status_code == 200, "the proxy's loop is not blocked"
            assert publisher.stats().records_dropped == 0

            small_disk.free()  # space comes back: both take work again by themselves
            wait_for(lambda: call("ro-after").status_code == 200, 30, "the proxy to take calls again")
            wait_for(lambda: export().status_code == 200, 30, "the collector to take spans again")
            assert client.post(f"{proxy.url}/rollouts/ro-rewarded/reward", json={"reward": 1.0}).status_code == 202
    finally:
        collector.stop()
        proxy.stop()
        model_server.stop()
    private_broker.start()
    create_topics(topics_config, private_broker.bootstrap)
    wait_for(lambda: publisher.stats().state == "connected", 30, "the journal's replay")
    publisher.close(30)
    assert publisher.stats().records_dropped == 0
    wanted = {f"{number:016x}" for number in exported}
    landed = read_topic(client_options(topics_config.kafka, private_broker.bootstrap),
                        topic_name(topics_config.topics, "spans"),
                        lambda found: wanted <= {span["span_id"] for span in found.spans}
                        and all(found.of(rollout)[0] for rollout in [*calls, "ro-rewarded"]), timeout_s=60)
    exported_ids = [span["span_id"] for span in landed.spans if span["span_id"] in wanted]
    assert sorted(exported_ids) == sorted(wanted), "every span the collector acknowledged arrived, once"
    llm_spans = {rollout: len([s for s in landed.of(rollout)[0] if s["kind"] == "LLM"]) for rollout in calls}
    assert set(llm_spans.values()) == {1}, llm_spans
    assert landed.of("ro-refused")[0] == [], "a refused call was not run, so it has no span"
    assert len([s for s in landed.of("ro-rewarded")[0] if s["kind"] == "REWARD"]) == 1


def test_a_full_broker_store_is_an_outage_the_journal_rides_out(topics_config, tmp_path, caplog):
    """tansu keeps its log in the embedded object store; that store's disk fills up mid-stream."""
    caplog.set_level(logging.WARNING)
    disk = SmallDisk(tmp_path / "store-disk", 24 * 1024 * 1024)
    store = ObjectStoreServer(disk.path / "store", [BUCKET])
    store_thread = ServerThread(store.app)
    port = free_port()
    storage, environment = s3_storage(store_thread.url)
    with open(tmp_path / "tansu.log", "wb") as tansu_log:
        broker = subprocess.Popen(tansu_command(find_tansu(None, tmp_path), "127.0.0.1", port, storage),
                                  env=environment, stdout=tansu_log, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    try:
        wait_for_port("127.0.0.1", port, 10, broker)
        create_topics(topics_config, bootstrap)
        publisher = SpanPublisher(topics_config, bootstrap, journal_dir=tmp_path / "journal", linger_ms=5,
                                  request_timeout_ms=1500, probe_interval_s=0.2, max_buffered_bytes=1 << 20).start()
        published = 0

        def publish(count: int) -> None:
            nonlocal published
            for _ in range(count):
                publisher.publish(make_span(f"ro-{published % 8}", published, tokens=30))
                published += 1
                time.sleep(0.002)

        publish(300)
        publisher.flush(30)
        disk.fill(leave_bytes=64 * 1024)
        publish(1500)  # the store refuses the broker's writes: the broker fails produce requests, the journal takes
        wait_for(lambda: publisher.stats().spans_journaled > 0, 30, "the publisher to journal what the broker refused")
        assert broker.poll() is None, "a full store does not stop the broker"
        disk.free()
        publish(300)
        wait_for(lambda: publisher.stats().state == "connected" and publisher.stats().buffered_bytes == 0, 60,
                 "the journal's replay once the store has room")
        publisher.close(30)
        assert publisher.stats().records_dropped == 0
        missing = [index for index, count in arrivals(topics_config, bootstrap, 0, published).items() if count == 0]
        assert missing == [], f"{len(missing)} of {published} spans lost"  # at least once: a broker that failed a
        # produce after storing part of it gets those records again from the journal; span ids make that harmless
    finally:
        broker.kill()
        broker.wait()
        store_thread.stop()
        store.close()
        disk.unmount()
    messages = [record.getMessage() for record in caplog.records if record.name == "agentstream.objectstore"]
    assert any("refuses writes" in message for message in messages)
    assert not any(record.exc_info for record in caplog.records if record.name.startswith("agentstream"))
