"""The main job on a fresh machine: stack up, publish real Avro spans, land them in ClickHouse, query, stack down.

This is the foundation-stage demo; it grows into the end-to-end training demo as the runner,
stream processors and trainer land.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from infra.clickhouse import connect
from infra.config import Config
from infra.kafka import client_options, topic_name
from infra.stack import BROKER, CLICKHOUSE, Stack
from schemas import SPAN_BATCH, AvroCodec
from streams.rows import SPAN_COLUMNS, span_row

DEMO_QUERY = """
SELECT agent_name, kind, count() AS spans, round(avg(duration_ms), 1) AS avg_ms,
       sum(length(response_token_ids)) AS response_tokens, round(sum(reward), 2) AS reward
FROM spans FINAL
WHERE task_id LIKE 'demo-%'
GROUP BY agent_name, kind
ORDER BY agent_name, kind
"""


def demo_rollout(agent: str, task_index: int, rng: random.Random) -> list[dict]:
    """The spans one math-agent rollout emits: an agent span, an LLM call with token ids, a tool call, a reward."""
    rollout_id = f"demo-{uuid.uuid4().hex[:12]}"
    attempt_id = f"{rollout_id}-a1"
    start = int(time.time() * 1e6)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    prompt_ids = [rng.randrange(49152) for _ in range(24)]
    response_ids = [rng.randrange(49152) for _ in range(rng.randint(6, 18))]
    root = f"{rollout_id}-root"
    common = {"rollout_id": rollout_id, "attempt_id": attempt_id, "agent_name": agent, "task_id": f"demo-{task_index}"}
    return [
        {**common, "span_id": root, "name": agent, "kind": "AGENT", "start_time_us": start,
         "end_time_us": start + 90_000, "status": "OK"},
        {**common, "span_id": f"{rollout_id}-llm", "parent_id": root, "name": "chat SmolLM2-135M-Instruct",
         "kind": "LLM", "start_time_us": start + 1_000, "end_time_us": start + 61_000, "status": "OK",
         "model": "SmolLM2-135M-Instruct", "policy_version": 0,
         "attributes": {"gen_ai.system": "agentstream-dev", "gen_ai.request.model": "SmolLM2-135M-Instruct",
                        "gen_ai.usage.input_tokens": str(len(prompt_ids)),
                        "gen_ai.usage.output_tokens": str(len(response_ids))},
         "prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
         "response_logprobs": [round(-rng.random() * 2, 4) for _ in response_ids]},
        {**common, "span_id": f"{rollout_id}-tool", "parent_id": root, "name": "calculator", "kind": "TOOL",
         "start_time_us": start + 62_000, "end_time_us": start + 63_000, "status": "OK",
         "attributes": {"gen_ai.tool.name": "calculator", "input": f"{a}+{b}", "output": str(a + b)}},
        {**common, "span_id": f"{rollout_id}-reward", "parent_id": root, "name": "reward", "kind": "REWARD",
         "start_time_us": start + 89_000, "end_time_us": start + 89_000, "status": "OK",
         "reward": float(rng.random() < 0.6), "reward_dimensions": {"correct": 1.0, "format": 0.5}},
    ]


async def publish_and_land(config: Config, bootstrap: str, clickhouse_url: str, spans_by_rollout: list[list[dict]],
                           say: Callable[[str], None]) -> int:
    """Publish each rollout as one SpanBatch record keyed by rollout id, then read the topic back into ClickHouse."""
    codec = AvroCodec()
    options = client_options(config.kafka, bootstrap)
    topic = topic_name(config.topics, "spans")
    producer = AIOKafkaProducer(**options, acks="all", linger_ms=5)
    await producer.start()
    try:
        for spans in spans_by_rollout:
            await producer.send(topic, key=spans[0]["rollout_id"].encode(), value=codec.encode_span_batch(spans))
        await producer.flush()
    finally:
        await producer.stop()
    expected = sum(len(spans) for spans in spans_by_rollout)
    say(f"published {expected} spans in {len(spans_by_rollout)} Avro SpanBatch records to {topic}")

    wanted = {spans[0]["rollout_id"] for spans in spans_by_rollout}
    consumer = AIOKafkaConsumer(topic, **options, group_id="agentstream-demo", auto_offset_reset="earliest",
                                enable_auto_commit=False, session_timeout_ms=3000, heartbeat_interval_ms=500)
    await consumer.start()
    rows = []
    try:
        deadline = time.monotonic() + 60
        while len(rows) < expected and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    _, batch = codec.decode(record.value, SPAN_BATCH)
                    rows.extend(span_row(span) for span in batch["spans"] if span["rollout_id"] in wanted)
        await consumer.commit()
    finally:
        await consumer.stop()
    client = connect(config.clickhouse, clickhouse_url, database=config.clickhouse.database)
    client.insert("spans", rows, column_names=list(SPAN_COLUMNS))
    client.close()
    say(f"consumed them back and inserted {len(rows)} rows into ClickHouse {config.clickhouse.database}.spans")
    return len(rows)


def run_demo(config: Config, say: Callable[[str], None] = print, rollouts: int = 8) -> None:
    stack = Stack(config)
    already_running = {name for name in (BROKER, CLICKHOUSE)
                       if (record := stack.services.record(name)) and record.alive()}
    say("== agentstream up")
    endpoints = stack.up(progress=say)
    try:
        rng = random.Random(7)
        spans = [demo_rollout("math-agent" if i % 2 else "support-agent", i, rng) for i in range(rollouts)]
        asyncio.run(publish_and_land(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, spans, say))
        say("== agentstream sql")
        say(DEMO_QUERY.strip())
        client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database, readonly=True)
        result = client.query(DEMO_QUERY)
        client.close()
        from pipeline.cli import render

        say(render(result.column_names, result.result_rows, "table").rstrip())
    finally:
        if already_running:
            say(f"== leaving the stack running ({', '.join(sorted(already_running))} was up before the demo)")
        else:
            say("== agentstream down")
            stack.down(progress=say)
