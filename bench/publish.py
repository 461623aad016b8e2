"""Throughput of the span publisher: 1 KB LLM spans from one process to a private broker, and the encoder alone.

The encoder figures come first (no broker: their lines say ``"broker": null``). Then, for each broker
``--broker`` names (tansu, Apache Kafka, or both, the default): a machine calibration line, a private
stack on free loopback ports with that broker, publishing for about --seconds through one SpanPublisher
(64 rollouts in flight, a RolloutEvent after every 16th span of a rollout), counted until every span is
acknowledged by the broker (after flush), the stack stopped. Prints one JSON line per figure, each naming
its broker.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import time
from pathlib import Path
from typing import Any

from agentstream.infra.kafka import client_options, idempotence_granted, message_counts, topic_name
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.schemas import SPAN_BATCH, AvroCodec
from agentstream.schemas.span_writer import SpanBatchEncoder, prepare_span
from agentstream.stack.machine import calibrate
from bench.common import add_broker_option, chosen_brokers, llm_span, private_stack
from bench.common import emit as emit_figure

BENCH = "publisher"
emit = functools.partial(emit_figure, BENCH)


def encoder_figures(pool: list[dict[str, Any]], rollouts: int) -> float:
    """Spans per second through prepare + one vectorized SpanBatch pass, against fastavro on the same spans."""
    encoder, codec = SpanBatchEncoder(), AvroCodec()
    sizes = [len(encoder.encode_span(span)) - 5 for span in pool]
    emit("span_encoded_bytes", statistics.mean(sizes), "bytes", min=min(sizes), max=max(sizes),
         prompt_ids=100, response_ids=100, logprobs=100, attributes=4, broker=None)
    per_record = len(pool) // rollouts
    spans = pool * 8
    rates = []
    for _ in range(3):
        started = time.perf_counter()
        prepared = [prepare_span(span) for span in spans]
        encoder.encode_batches([prepared[i:i + per_record] for i in range(0, len(spans), per_record)])
        rates.append(len(spans) / (time.perf_counter() - started))
    emit("span_encode_per_s", max(rates), "spans/s", spans_per_record=per_record, broker=None)
    started = time.perf_counter()
    for i in range(0, len(spans), per_record):
        codec.encode(SPAN_BATCH, {"spans": spans[i:i + per_record]})
    emit("fastavro_span_encode_per_s", len(spans) / (time.perf_counter() - started), "spans/s",
         spans_per_record=per_record, broker=None)
    return statistics.mean(sizes)


def publish_figures(config, bootstrap: str, pool: list[dict[str, Any]], rollouts: int, seconds: float,
                    journal_dir: Path, span_bytes: float) -> None:
    """Spans per second through one SpanPublisher until the broker acknowledged every one."""
    rollout_ids = [f"rollout-{n:06d}" for n in range(rollouts)]
    published = events = 0
    with SpanPublisher(config, bootstrap, journal_dir=journal_dir) as publisher:
        started, cpu_started = time.perf_counter(), time.process_time()
        stop_at = started + seconds
        while time.perf_counter() < stop_at:
            for _ in range(1024):
                # publish() encodes the dict before it returns and keeps no reference: reuse the pool's dicts
                span = pool[published % len(pool)]
                span["span_id"] = f"span-{published:012d}"
                span["rollout_id"] = rollout_ids[published % rollouts]
                publisher.publish(span)
                published += 1
                if published % (16 * rollouts) < rollouts:  # each rollout's 16th span ends an attempt
                    publisher.publish_event({"rollout_id": span["rollout_id"], "attempt_id": "attempt-1",
                                             "event": "SUCCEEDED", "at_us": span["end_time_us"]})
                    events += 1
        queued = time.perf_counter() - started
        publisher.flush(120)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        stats = publisher.stats()
    assert stats.spans_published == published and stats.events_published == events, stats
    assert stats.spans_journaled == 0 and stats.records_dropped == 0, stats
    topic = topic_name(config.topics, "spans")
    options = client_options(config.kafka, bootstrap)
    records = asyncio.run(message_counts(options, {topic: config.topics.partitions}))
    idempotent = asyncio.run(idempotence_granted(config.kafka.idempotence, options))
    broker = config.stack.broker
    emit("publish_spans_per_s", published / elapsed, "spans/s", broker=broker, idempotent=idempotent,
         spans=published, events=events,
         seconds=round(elapsed, 2), flush_s=round(elapsed - queued, 3), span_bytes=round(span_bytes, 1),
         kafka_records=records[topic], spans_per_record=round(published / max(1, records[topic] - events), 1),
         rollouts=rollouts, acks="all", process_cpu_s=round(cpu, 2), target=50_000)
    emit("publish_mb_per_s", published * span_bytes / elapsed / 1e6, "MB/s", broker=broker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts publishing at the same time")
    add_broker_option(parser)
    args = parser.parse_args()
    rng = random.Random(7)
    # 512 distinct spans (about 5 MB of Python objects), cycled: colder in cache than a span an agent
    # has just built, which is what publish() sees in production.
    pool = [llm_span(rng, index) for index in range(512)]
    span_bytes = encoder_figures(pool, args.rollouts)
    for broker in chosen_brokers(args.broker):
        calibration = calibrate()
        emit("machine_calibration", calibration.python_loop_s, "s", broker=broker, **calibration.as_dict())
        with private_stack(AGENTSTREAM_BROKER=broker) as (config, endpoints):
            publish_figures(config, endpoints.bootstrap_servers, pool, args.rollouts, args.seconds,
                            config.stack.home / "journal", span_bytes)


if __name__ == "__main__":
    main()
