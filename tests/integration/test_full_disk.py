"""A full disk is back-pressure, never loss: the publisher's journal on a real filesystem that fills up.

The broker is killed, so the publisher journals; the journal's disk (a small tmpfs the test mounts) fills
up. Nothing acknowledged to a caller may be dropped: the records the disk refused stay held, publishers
block for room, the journal takes them when space comes back, and the broker takes everything when it is
back, each span exactly once.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from agentstream.infra.kafka import client_options, topic_name
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.publisher.journal import Journal, Record
from tests.integration.test_publisher import create_topics, journal_files, make_span, read_spans_topic
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
        small_disk.fill(leave_bytes=192 * 1024)  # the journal gets a little room, then none
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
    counts = read_spans_topic(client_options(topics_config.kafka, private_broker.bootstrap),
                              topic_name(topics_config.topics, "spans"),
                              at_least=published - first_after_kill).span_counts()
    arrived = {index: counts[index] for index in range(first_after_kill, published)}
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
