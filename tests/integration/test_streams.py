"""Stream processors end to end: real broker, real ClickHouse, real `agentstream streams` worker processes."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from agentstream.infra.clickhouse import connect
from agentstream.schemas import ROLLOUT_EVENT, TASK, AvroCodec
from agentstream.schemas.container_file import container_file
from agentstream.schemas.contracts import TRAIN_ATTRIBUTE
from agentstream.schemas.span_writer import SpanBatchEncoder
from tests.support.streams_harness import (
    CODEC,
    Worker,
    create_topics,
    now_us,
    produce,
    rollout_records,
    wait_for,
    worker_env,
)

CONFIG = """
[streams]
app_id = "{app_id}"
grace_s = 0.2
idle_timeout_s = 1.5
reward_expiry_s = 4
session_timeout_s = 3

[[credit]]
agent = "skip-*"
train = false

[[credit]]
agent = "disc-*"
strategy = "discounted"
gamma = 0.5

[[credit]]
agent = "grpo-*"
strategy = "grpo"
group_size = 4
group_timeout_s = 3

[[credit]]
agent = "rare-*"
sample_rate = 0.0

[[credit]]
agent = "*"
strategy = "final"
"""


def read_all(bootstrap: str, topic: str, partitions: int, timeout_ms: int = 1500) -> list:
    async def go():
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            tps = [TopicPartition(topic, p) for p in range(partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            records = []
            while True:
                batch = await consumer.getmany(timeout_ms=timeout_ms)
                if not batch:
                    return records
                for items in batch.values():
                    records.extend(items)
        finally:
            await consumer.stop()

    return asyncio.run(go())


@pytest.fixture
def setup(tmp_path, stack, stack_config):
    tag = uuid.uuid4().hex[:8]
    env = worker_env(tmp_path, stack, f"s{tag}.", f"streams_{tag}", CONFIG.format(app_id=f"streams-{tag}"))
    create_topics(env)
    client = connect(stack_config.clickhouse, stack.clickhouse_url)
    workers: list[Worker] = []
    yield env, tag, client, workers
    for worker in workers:
        worker.stop()
    client.command(f"DROP DATABASE IF EXISTS streams_{tag}")
    client.close()


def query(client, sql: str):
    return client.query(sql).result_rows


def test_credit_strategies_late_rewards_expiry_and_dead_letters(setup, stack):
    env, tag, client, workers = setup
    db, spans_topic = f"streams_{tag}", f"s{tag}.spans"
    workers.append(Worker(env, env_path(env) / "worker.log").start())
    ms = 1000
    items = []

    def add(rollout_id, **kwargs):
        items.extend((rollout_id.encode(), value) for value in rollout_records(rollout_id, **kwargs))

    add("fin", agent="math", llm_at=[0, 20 * ms], rewards=[(5 * ms, 0.5), (30 * ms, 1.0)])
    add("disc", agent="disc-a", llm_at=[0, 20 * ms, 40 * ms], rewards=[(10 * ms, 1.0), (50 * ms, 2.0)])
    for index, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        add(f"g1-{index}", agent="grpo-a", group="g1", rewards=[(5 * ms, reward)])
    for index in range(4):
        add(f"g2-{index}", agent="grpo-a", group="g2", rewards=[(5 * ms, 1.0)])
    add("notok", agent="math", llm_at=[0], tokens=False, rewards=[(5 * ms, 1.0)])
    add("failed", agent="math", terminal="FAILED", rewards=[(5 * ms, 1.0)])
    add("skipped", agent="skip-me", rewards=[(5 * ms, 1.0)])
    add("late", agent="online", started=False, terminal=None)
    add("expires", agent="online", started=False, terminal=None)
    garbage = [(b"g1", b"\x07not avro at all"), (b"g2", b"\x00" + struct.pack(">I", 12345) + b"\x02x"),
               (b"g3", AvroCodec().encode(TASK, {"task_id": "t", "rollout_id": "r", "input": "{}", "timeout_s": 1.0,
                                                 "enqueued_at_us": 0})),
               (b"g4", CODEC.encode_span_batch([{  # a known writer schema, but the body is cut short
                   "span_id": "cut", "rollout_id": "g4", "attempt_id": "g4-1", "name": "n", "kind": "LLM",
                   "start_time_us": 1, "end_time_us": 2, "attributes": {}, "prompt_token_ids": [1, 2, 3]}])[:-6]),
               (b"g5", None)]  # a tombstone: it used to kill every worker that met it
    asyncio.run(produce(stack.bootstrap_servers, spans_topic, items + garbage))

    def statuses():
        return dict(query(client, f"SELECT rollout_id, status FROM {db}.rollouts FINAL"))

    wait_for(lambda: statuses().get("late") == "AWAITING_REWARD" and len(statuses()) >= 15, 60, what="rollouts")
    late_reward = CODEC.encode_span_batch([{
        "span_id": "late-reward", "rollout_id": "late", "attempt_id": "late-1", "name": "reward", "kind": "REWARD",
        "start_time_us": now_us(), "end_time_us": now_us(), "attributes": {"agentstream.reward.late": "true"},
        "reward": 0.75}])
    asyncio.run(produce(stack.bootstrap_servers, spans_topic, [(b"late", late_reward)]))
    wait_for(lambda: statuses().get("late") == "SUCCEEDED", 30, what="late reward")
    wait_for(lambda: statuses().get("expires") == "EXPIRED", 30, what="expiry")
    after_expiry = CODEC.encode_span_batch([{
        "span_id": "too-late", "rollout_id": "expires", "attempt_id": "expires-1", "name": "reward", "kind": "REWARD",
        "start_time_us": now_us(), "end_time_us": now_us(), "attributes": {}, "reward": 1.0}])
    asyncio.run(produce(stack.bootstrap_servers, spans_topic, [(b"expires", after_expiry)]))

    final = statuses()
    assert final["fin"] == final["disc"] == final["skipped"] == final["notok"] == "SUCCEEDED"
    assert final["failed"] == "FAILED"

    def transitions():
        return {row[0]: row[1:] for row in query(
            client, f"SELECT span_id, step_index, reward, return_value, advantage, policy_version FROM "
                    f"{db}.transitions FINAL")}

    wait_for(lambda: len(transitions()) == 10, 30, what="10 transitions")
    got = transitions()
    assert got["fin-llm0"] == (0, 1.0, 1.0, 1.0, 1) and got["fin-llm1"][0] == 1
    assert [got[f"disc-llm{i}"][1:4] for i in range(3)] == [(1.0, 1.5, 1.5), (0.0, 1.0, 1.0), (2.0, 2.0, 2.0)]
    assert [round(got[f"g1-{i}-llm0"][3], 4) for i in range(4)] == [1.0, -1.0, -1.0, 1.0]
    assert got["late-llm0"][1:4] == (0.75, 0.75, 0.75)
    assert not any(key.startswith(("g2-", "notok", "failed", "skipped", "expires")) for key in got)
    without_tokens = f"SELECT llm_calls_without_tokens FROM {db}.rollouts FINAL WHERE rollout_id = 'notok'"
    assert query(client, without_tokens) == [(1,)]
    produced = sum(len(CODEC.decode(value)[1]["spans"]) for _, value in items
                   if CODEC.decode(value)[0].endswith("Batch"))
    wait_for(lambda: query(client, f"SELECT count() FROM {db}.spans FINAL") == [(produced + 2,)], 20,
             what="every span in ClickHouse, once")

    span_count = query(client, f"SELECT count() FROM {db}.spans FINAL WHERE rollout_id = 'disc'")
    assert span_count == [(5,)]
    records = read_all(stack.bootstrap_servers, f"s{tag}.transitions", 4)
    on_topic = [t for r in records for t in CODEC.decode(r.value)[1]["transitions"]]
    assert {t["span_id"] for t in on_topic} == set(got)
    assert {r.key for r in records} == {b"m"}
    for record in records:
        rollouts = dict(record.headers)["agentstream-rollouts"].decode().split(",")
        assert set(rollouts) >= {t["rollout_id"] for t in CODEC.decode(record.value)[1]["transitions"]}
    fin = next(t for t in on_topic if t["span_id"] == "fin-llm1")
    assert fin["prompt_token_ids"] == [1, 2, 3, 1] and fin["response_token_ids"] == [7, 1]
    assert fin["behaviour_logprobs"] == [-0.5, -0.25]

    dead = [CODEC.decode(r.value)[1] for r in read_all(stack.bootstrap_servers, f"s{tag}.dlq", 1)]
    assert sorted(d["key"] for d in dead) == [b"g1", b"g2", b"g3", b"g4", b"g5"]
    by_key = {d["key"]: d for d in dead}
    assert by_key[b"g1"]["error_type"] == "NotWireFormat" and by_key[b"g1"]["value"] == b"\x07not avro at all"
    assert by_key[b"g2"]["error_type"] == "UnknownSchemaId"
    assert by_key[b"g3"]["error_type"] == "UnexpectedRecord"
    assert by_key[b"g4"]["error_type"] == "MalformedSpan" and "cut short" in by_key[b"g4"]["error"]
    assert by_key[b"g5"]["error_type"] == "NotWireFormat" and "tombstone" in by_key[b"g5"]["error"]
    assert by_key[b"g5"]["value"] == b""
    assert all(d["source_topic"] == spans_topic and d["offset"] >= 0 for d in dead)
    assert statuses()["expires"] == "EXPIRED", "a reward after expiry does not revive the rollout"


def env_path(env: dict):
    from pathlib import Path

    return Path(env["AGENTSTREAM_CONFIG"]).parent


def _rollout_items(prefix: str, count: int) -> list[tuple[bytes, bytes]]:
    items = []
    for index in range(count):
        rollout_id = f"{prefix}-{index}"
        items.extend((rollout_id.encode(), value) for value in rollout_records(
            rollout_id, agent="math", llm_at=[0, 1000], rewards=[(2000, float(index % 2))]))
    return items


def _counts(client, db: str) -> tuple[int, int, int]:
    return (query(client, f"SELECT count() FROM {db}.spans FINAL")[0][0],
            query(client, f"SELECT countIf(status = 'SUCCEEDED') FROM {db}.rollouts FINAL")[0][0],
            query(client, f"SELECT count() FROM {db}.transitions FINAL")[0][0])


def _produce_in_waves(bootstrap: str, topic: str, items: list, waves: int, between, pause_s: float = 0.3) -> None:

    size = len(items) // waves + 1
    for wave in range(waves):
        asyncio.run(produce(bootstrap, topic, items[wave * size:(wave + 1) * size]))
        between(wave)
        time.sleep(pause_s)


def test_sigkill_mid_stream_loses_nothing_and_counts_once(setup, stack):
    env, tag, client, workers = setup
    db, topic = f"streams_{tag}", f"s{tag}.spans"
    log_path = env_path(env) / "worker.log"
    workers.append(Worker(env, log_path).start())
    items = _rollout_items("k", 300)

    def kill_then_restart(wave: int) -> None:
        if wave == 2:
            workers[-1].kill()
        if wave == 4:
            workers.append(Worker(env, log_path).start())

    _produce_in_waves(stack.bootstrap_servers, topic, items, 8, kill_then_restart)
    wait_for(lambda: _counts(client, db), 90, what="all spans, rollouts, transitions", equals=(900, 300, 600))
    on_topic = [t["transition_id"] for r in read_all(stack.bootstrap_servers, f"s{tag}.transitions", 4)
                for t in CODEC.decode(r.value)[1]["transitions"]]
    assert len(set(on_topic)) == 600, "every transition reached the topic (replays may repeat some, never lose one)"
    assert "Ready" in workers[-1].log() and workers[-1].process.poll() is None


def test_commits_never_pass_the_first_record_of_an_open_rollout(setup, stack):
    """Rollouts kept open (a long grace) while their spans and end events are stored and acknowledged: the
    group's committed offsets must stay at their STARTED records, the first in each partition, so a crash
    replays them (faust alone committed past a held record at the head of a partition)."""
    env, tag, client, workers = setup
    config_path = env_path(env) / "agentstream.toml"
    config_path.write_text(config_path.read_text().replace("grace_s = 0.2", "grace_s = 30"))
    workers.append(Worker(env, env_path(env) / "worker.log").start())
    items = _rollout_items("open", 12)
    asyncio.run(produce(stack.bootstrap_servers, f"s{tag}.spans", items))
    wait_for(lambda: query(client, f"SELECT count() FROM streams_{tag}.spans FINAL"), 30, what="spans stored",
             equals=[(36,)])
    time.sleep(2)  # several commit intervals (0.5 s) after every span and end event was acknowledged

    async def committed() -> dict[int, int | None]:
        consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap_servers, group_id=f"streams-{tag}",
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            return {p: await consumer.committed(TopicPartition(f"s{tag}.spans", p)) for p in range(4)}
        finally:
            await consumer.stop()

    offsets = asyncio.run(committed())
    assert all(offset in (None, 0) for offset in offsets.values()), offsets
    assert query(client, f"SELECT count() FROM streams_{tag}.rollouts FINAL") == [(0,)]


def test_rollout_first_seen_mid_way_is_assembled_from_clickhouse_and_what_arrived(setup, stack):
    """After a restart the replay may begin inside a rollout: its STARTED event and first spans lie before the
    committed offset (already in ClickHouse), the rest arrive. It must be credited whole, not from its tail."""
    env, tag, client, workers = setup
    db, spans_topic = f"streams_{tag}", f"s{tag}.spans"
    workers.append(Worker(env, env_path(env) / "worker.log").start())
    _, batch, succeeded = rollout_records("mid", agent="math", llm_at=[0, 20_000, 40_000], rewards=[(50_000, 1.0)])
    spans = CODEC.decode(batch)[1]["spans"]
    stored = CODEC.encode_span_batch(spans[:2])
    _, _, schema = CODEC.writer_schema(stored)
    client.raw_insert(f"{db}.spans_ingest", None, container_file(schema, [stored[5:]]), fmt="Avro",
                      settings={"input_format_avro_allow_missing_fields": 1})
    asyncio.run(produce(stack.bootstrap_servers, spans_topic,
                        [(b"mid", CODEC.encode_span_batch(spans[2:])), (b"mid", succeeded)]))
    wait_for(lambda: query(client, f"SELECT count() FROM {db}.transitions FINAL"), 30, what="transitions",
             equals=[(3,)])
    assert query(client, f"SELECT span_id, step_index, reward FROM {db}.transitions FINAL ORDER BY step_index") == [
        ("mid-llm0", 0, 1.0), ("mid-llm1", 1, 1.0), ("mid-llm2", 2, 1.0)]
    assert query(client, f"SELECT status, span_count, llm_calls FROM {db}.rollouts FINAL") == [("SUCCEEDED", 4, 3)]


def test_two_workers_split_the_partitions(setup, stack):
    env, tag, client, workers = setup
    db, topic = f"streams_{tag}", f"s{tag}.spans"
    first = Worker(env, env_path(env) / "w1.log").start()
    workers.append(first)
    second = Worker(env, env_path(env) / "w2.log").start()
    workers.append(second)

    def assignment(worker: Worker) -> list[int]:
        lines = [line for line in worker.log().splitlines() if f"assigned s{tag}.spans partitions" in line]
        return eval(lines[-1].rsplit("partitions ", 1)[1]) if lines else []

    wait_for(lambda: sorted(assignment(first) + assignment(second)) == [0, 1, 2, 3] and assignment(second), 60,
             what="a rebalance giving both workers partitions")
    assert set(assignment(first)).isdisjoint(assignment(second))
    asyncio.run(produce(stack.bootstrap_servers, topic, _rollout_items("two", 200)))
    wait_for(lambda: _counts(client, db), 60, what="both workers' output", equals=(600, 200, 400))


def test_clickhouse_outage_holds_and_retries(setup, stack, stack_config, tmp_path):
    import subprocess
    import sys

    from agentstream.infra.processes import free_port, wait_for_port

    env, tag, _, workers = setup
    port = free_port()
    data = tmp_path / "outage-ch"

    def start_clickhouse():
        command = [sys.executable, "-m", "agentstream.stack.chserver", "--port", str(port), "--data-dir", str(data)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", port, 30, process)
        return process

    clickhouse = start_clickhouse()
    env = {**env, "CLICKHOUSE_URL": f"http://127.0.0.1:{port}"}
    log_path = env_path(env) / "outage.log"
    workers.append(Worker(env, log_path).start())
    db, topic = f"streams_{tag}", f"s{tag}.spans"
    items = _rollout_items("o", 150)
    asyncio.run(produce(stack.bootstrap_servers, topic, items[:150]))
    client = connect(stack_config.clickhouse, f"http://127.0.0.1:{port}")
    wait_for(lambda: _counts(client, db)[0] > 0, 30, what="first rows")
    client.close()
    clickhouse.kill()
    clickhouse.wait()
    asyncio.run(produce(stack.bootstrap_servers, topic, items[150:]))
    time.sleep(3)
    assert "unavailable" in workers[-1].log(), "the worker says ClickHouse is unavailable and that it retries"
    assert workers[-1].process.poll() is None, "an outage does not crash the worker"
    clickhouse = start_clickhouse()
    try:
        client = connect(stack_config.clickhouse, f"http://127.0.0.1:{port}")
        wait_for(lambda: _counts(client, db), 90, what="everything after the outage", equals=(450, 150, 300))
        client.close()
    finally:
        workers[-1].stop()
        clickhouse.terminate()
        clickhouse.wait()


def test_a_full_clickhouse_disk_holds_offsets_and_resumes_losing_nothing(setup, stack, stack_config, tmp_path):
    """ClickHouse's data on a real filesystem that fills up: inserts fail (NOT_ENOUGH_SPACE), the worker holds its
    offsets and retries, nothing goes to dead letters, and everything lands once the disk has room again."""
    import subprocess
    import sys

    from agentstream.infra.processes import free_port, wait_for_port
    from tests.support.small_disk import SmallDisk

    env, tag, _, workers = setup
    port = free_port()
    disk = SmallDisk(tmp_path / "ch-disk", 48 * 1024 * 1024)
    command = [sys.executable, "-m", "agentstream.stack.chserver", "--port", str(port),
               "--data-dir", str(disk.path / "data")]
    clickhouse = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 30, clickhouse)
        env = {**env, "CLICKHOUSE_URL": f"http://127.0.0.1:{port}"}
        workers.append(Worker(env, env_path(env) / "full-disk.log").start())
        db, topic = f"streams_{tag}", f"s{tag}.spans"
        items = _rollout_items("f", 150)
        asyncio.run(produce(stack.bootstrap_servers, topic, items[:150]))
        client = connect(stack_config.clickhouse, f"http://127.0.0.1:{port}")
        wait_for(lambda: _counts(client, db) == (150, 50, 100), 60, what="the rows before the disk fills")
        disk.fill(leave_bytes=256 * 1024)  # less than the 1 MiB ClickHouse reserves for a new part
        asyncio.run(produce(stack.bootstrap_servers, topic, items[150:]))
        wait_for(lambda: "NOT_ENOUGH_SPACE" in workers[-1].log(), 30, what="an insert the full disk refuses")
        time.sleep(2)
        assert workers[-1].process.poll() is None, "a full disk does not crash the worker"
        assert _counts(client, db) == (150, 50, 100), "nothing was written while the disk was full"
        disk.free()
        wait_for(lambda: _counts(client, db), 90, what="everything once the disk has room", equals=(450, 150, 300))
        client.close()
        assert read_all(stack.bootstrap_servers, f"s{tag}.dlq", 1, timeout_ms=500) == [], "no dead letters"
        assert "is back" in workers[-1].log()
    finally:
        workers[-1].stop() if workers else None
        clickhouse.terminate()
        clickhouse.wait()
        disk.unmount()


def flagged_records(rollout_id: str, flags: list[str | None], **kwargs) -> list[tuple[bytes, bytes]]:
    """``rollout_records`` with ``agentstream.train`` set on the LLM spans: ``flags[i]`` on call i (None: absent)."""
    out = []
    for value in rollout_records(rollout_id, llm_at=[index * 1000 for index in range(len(flags))], **kwargs):
        name, datum = CODEC.decode(value)
        if name.endswith("Batch"):
            for span in datum["spans"]:
                flag = flags[int(span["span_id"].rsplit("llm", 1)[1])] if span["kind"] == "LLM" else None
                if flag is not None:
                    span["attributes"] = {"gen_ai.system": "test", TRAIN_ATTRIBUTE: flag}
            value = CODEC.encode_span_batch(datum["spans"])
        out.append((rollout_id.encode(), value))
    return out


def test_training_selection_opt_out_opt_in_and_sampling(setup, stack):
    """Every rollout keeps its rollouts row; only the selected ones produce transitions. An explicit
    agentstream.train=false wins; true trains even where the rule samples none (rare-*: sample_rate 0). The
    late ones are decided on spans read back from ClickHouse, so the stored spans must carry the flag."""
    env, tag, client, workers = setup
    db, spans_topic = f"streams_{tag}", f"s{tag}.spans"
    workers.append(Worker(env, env_path(env) / "worker.log").start())
    reward = {"rewards": [(5000, 1.0)]}
    items = (flagged_records("out", ["false", None], agent="math", **reward)
             + flagged_records("plain", [None, None], agent="math", **reward)
             + flagged_records("rare", [None, None], agent="rare-a", **reward)
             + flagged_records("rare-in", [None, "true"], agent="rare-a", **reward)
             + flagged_records("rare-both", ["true", "false"], agent="rare-a", **reward)
             + flagged_records("skip-in", ["true"], agent="skip-me", **reward)
             + flagged_records("failed-in", ["true"], agent="math", terminal="FAILED", **reward)
             + flagged_records("late-out", ["false"], agent="math", started=False, terminal=None)
             + flagged_records("late-in", ["true"], agent="rare-a", started=False, terminal=None))
    asyncio.run(produce(stack.bootstrap_servers, spans_topic, items))

    def rows():
        return {r[0]: r[1:] for r in query(client, f"SELECT rollout_id, status, training FROM {db}.rollouts FINAL")}

    wait_for(lambda: len(rows()) == 9 and rows()["late-in"][0] == "AWAITING_REWARD", 60, what="9 rollouts rows")
    assert rows()["late-out"] == rows()["late-in"] == ("AWAITING_REWARD", "")
    late = [(rollout_id.encode(), CODEC.encode_span_batch([{  # the rewards carry no flag: the stored spans do
        "span_id": f"{rollout_id}-reward", "rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1", "name": "reward",
        "kind": "REWARD", "start_time_us": now_us(), "end_time_us": now_us(), "attributes": {}, "reward": 1.0}]))
        for rollout_id in ("late-out", "late-in")]
    asyncio.run(produce(stack.bootstrap_servers, spans_topic, late))
    wait_for(lambda: rows()["late-in"][0] == rows()["late-out"][0] == "SUCCEEDED", 30, what="late rewards")

    assert rows() == {
        "out": ("SUCCEEDED", "opted_out"), "plain": ("SUCCEEDED", "sampled"), "rare": ("SUCCEEDED", "sampled_out"),
        "rare-in": ("SUCCEEDED", "opted_in"), "rare-both": ("SUCCEEDED", "opted_out"),
        "skip-in": ("SUCCEEDED", "not_trained"), "failed-in": ("FAILED", ""),
        "late-out": ("SUCCEEDED", "opted_out"), "late-in": ("SUCCEEDED", "opted_in")}

    def trained() -> set[str]:
        return {r[0] for r in query(client, f"SELECT DISTINCT rollout_id FROM {db}.transitions FINAL")}

    wait_for(trained, 30, what="transitions", equals={"plain", "rare-in", "late-in"})
    time.sleep(1.5)  # a few sink intervals more: nothing else arrives
    assert trained() == {"plain", "rare-in", "late-in"}
    assert query(client, f"SELECT count() FROM {db}.transitions FINAL") == [(5,)]
    on_topic = {t["rollout_id"] for r in read_all(stack.bootstrap_servers, f"s{tag}.transitions", 4)
                for t in CODEC.decode(r.value)[1]["transitions"]}
    assert on_topic == {"plain", "rare-in", "late-in"}
    stored = query(client, f"SELECT span_id, attributes['agentstream.train'] FROM {db}.spans FINAL "
                           "WHERE rollout_id = 'out' ORDER BY span_id")
    assert stored == [("out-llm0", "false"), ("out-llm1", ""), ("out-r0", "")], "every span is still captured"


def test_token_ids_in_sized_blocks_reach_clickhouse_and_transitions_as_written(setup, stack):
    """The publisher writes token ids as one block with its byte size (the worker steps over it without walking the
    varints): ClickHouse decodes them, and the transition copies them, to the same values."""
    env, tag, client, workers = setup
    db, spans_topic = f"streams_{tag}", f"s{tag}.spans"
    workers.append(Worker(env, env_path(env) / "worker.log").start())
    prompt, response = [0, 1, 63, 64, 8191, 8192, 49151, 2**31 - 1], [-1, 300, 128000]
    span = {"span_id": "sized-llm", "rollout_id": "sized", "attempt_id": "sized-1", "name": "chat", "kind": "LLM",
            "start_time_us": now_us(), "end_time_us": now_us() + 10, "agent_name": "agent", "model": "m",
            "policy_version": 2, "prompt_token_ids": prompt, "response_token_ids": response,
            "response_logprobs": [-0.5, -0.25, -2.0]}
    reward = {"span_id": "sized-r", "rollout_id": "sized", "attempt_id": "sized-1", "name": "reward",
              "kind": "REWARD", "start_time_us": now_us(), "end_time_us": now_us(), "reward": 1.0}
    body = SpanBatchEncoder().encode_span_batch([span, reward])
    assert body != CODEC.encode_span_batch([span, reward]) and CODEC.decode(body)[1]["spans"][0]["prompt_token_ids"] \
        == prompt  # the sized blocks differ from fastavro's bytes, not in what they hold
    records = rollout_records("sized", llm_at=[])
    asyncio.run(produce(stack.bootstrap_servers, spans_topic,
                        [(b"sized", records[0]), (b"sized", body), (b"sized", records[-1])]))

    transitions = f"SELECT prompt_token_ids, response_token_ids, behaviour_logprobs FROM {db}.transitions FINAL"
    wait_for(lambda: query(client, transitions), 30, what="the transition")
    assert query(client, transitions) == [(prompt, [2**32 - 1, 300, 128000], [-0.5, -0.25, -2.0])]  # UInt32 columns
    assert query(client, f"SELECT prompt_token_ids, response_token_ids FROM {db}.spans FINAL "
                         "WHERE span_id = 'sized-llm'") == [(prompt, [2**32 - 1, 300, 128000])]
    (record,) = read_all(stack.bootstrap_servers, f"s{tag}.transitions", 4)
    (transition,) = CODEC.decode(record.value)[1]["transitions"]
    assert (transition["prompt_token_ids"], transition["response_token_ids"]) == (prompt, response)


def test_a_rollout_silent_past_the_idle_timeout_is_written_whole_once_its_spans_come(setup, stack):
    """A model or tool slower than ``idle_timeout_s``: the rollout's spans come after it was given up on, as its
    STARTED event's silence ran out and again after its first call. It must end SUCCEEDED with every call and its
    reward, as a rollout that kept time does, not as the fragments the timeouts cut."""
    env, tag, client, workers = setup
    db, spans_topic = f"streams_{tag}", f"s{tag}.spans"
    # the fragment written after the second silence waits for its reward: a wait far longer than this test's
    # silences, so a slow produce on a loaded machine cannot expire it before the rest comes
    config_path = env_path(env) / "agentstream.toml"
    config_path.write_text(config_path.read_text().replace("reward_expiry_s = 4", "reward_expiry_s = 60"))
    workers.append(Worker(env, env_path(env) / "worker.log").start())
    started, batch, succeeded = rollout_records("slow", agent="math", llm_at=[0, 20_000], rewards=[(30_000, 1.0)])
    spans = CODEC.decode(batch)[1]["spans"]
    silences = [started, CODEC.encode_span_batch(spans[:1])]  # each followed by more than idle_timeout_s of nothing
    for record in silences:
        asyncio.run(produce(stack.bootstrap_servers, spans_topic, [(b"slow", record)]))
        time.sleep(2.5)
    asyncio.run(produce(stack.bootstrap_servers, spans_topic,
                        [(b"slow", CODEC.encode_span_batch(spans[1:])), (b"slow", succeeded)]))
    wait_for(lambda: query(client, f"SELECT status, span_count, llm_calls, final_reward FROM {db}.rollouts FINAL "
                                   "WHERE rollout_id = 'slow' ORDER BY updated_at DESC LIMIT 1"), 30,
             what="the whole rollout", equals=[("SUCCEEDED", 3, 2, 1.0)])
    assert query(client, f"SELECT span_id, reward FROM {db}.transitions FINAL ORDER BY step_index") == [
        ("slow-llm0", 1.0), ("slow-llm1", 1.0)]
    trailing = CODEC.encode(ROLLOUT_EVENT, {"rollout_id": "slow", "attempt_id": "slow-1", "event": "HEARTBEAT",
                                            "at_us": now_us(), "task_id": "task", "agent_name": "math"})
    asyncio.run(produce(stack.bootstrap_servers, spans_topic, [(b"slow", trailing)]))  # sent as it ended
    time.sleep(4.0)  # past idle_timeout_s and a store: a rollout it had opened would now be written TIMED_OUT
    assert query(client, f"SELECT status FROM {db}.rollouts FINAL WHERE rollout_id = 'slow' "
                         "ORDER BY updated_at DESC LIMIT 1") == [("SUCCEEDED",)]


def test_an_end_event_after_the_spans_that_completed_its_rollout_rewrites_it_with_spans_not_inserted_yet(setup, stack):
    """A waiting rollout's last spans come in one batch, its end event in the next: the spans rewrite it whole, then
    the end event reads it back from ClickHouse, which holds those spans only after ``ingest_interval_s``. It was
    rewritten from what ClickHouse held (one call, no reward: AWAITING_REWARD, later EXPIRED): CI saw it twice."""
    env, tag, client, workers = setup
    db, spans_topic = f"streams_{tag}", f"s{tag}.spans"
    config_path = env_path(env) / "agentstream.toml"
    config_path.write_text(config_path.read_text().replace("reward_expiry_s = 4", "reward_expiry_s = 60\n"
                                                            "ingest_interval_s = 6"))  # spans wait 6 s for ClickHouse
    workers.append(Worker(env, env_path(env) / "worker.log").start())
    batch, succeeded = rollout_records("late", agent="math", llm_at=[0, 20_000], rewards=[(30_000, 1.0)],
                                       started=False)
    spans = CODEC.decode(batch)[1]["spans"]

    def latest(since_us: int = 0):
        return query(client, f"SELECT status, span_count, llm_calls, final_reward FROM {db}.rollouts FINAL "
                             f"WHERE rollout_id = 'late' AND toUnixTimestamp64Micro(updated_at) > {since_us} "
                             "ORDER BY updated_at DESC LIMIT 1")

    asyncio.run(produce(stack.bootstrap_servers, spans_topic, [(b"late", CODEC.encode_span_batch(spans[:1]))]))
    wait_for(latest, 20, what="the first call, silent past the idle timeout, waiting for its reward",
             equals=[("AWAITING_REWARD", 1, 1, None)])
    asyncio.run(produce(stack.bootstrap_servers, spans_topic, [(b"late", CODEC.encode_span_batch(spans[1:]))]))
    wait_for(latest, 20, what="the rollout rechecked with its reward", equals=[("SUCCEEDED", 3, 2, 1.0)])
    ended_us = now_us()
    asyncio.run(produce(stack.bootstrap_servers, spans_topic, [(b"late", succeeded)]))
    wait_for(lambda: latest(ended_us), 20, what="the rollout rewritten at its end event",
             equals=[("SUCCEEDED", 3, 2, 1.0)])
    assert query(client, f"SELECT span_id, reward FROM {db}.transitions FINAL ORDER BY step_index") == [
        ("late-llm0", 1.0), ("late-llm1", 1.0)]
