"""`agentstream dataset export` as a user runs it, over rollouts a real streams worker credited; `datasets` loads it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

from agentstream.infra.clickhouse import connect
from agentstream.schemas.dataset import read_rows
from agentstream.schemas.span_writer import SpanBatchEncoder
from tests.integration.test_streams import env_path
from tests.support.streams_harness import Worker, create_topics, now_us, produce, rollout_records, wait_for, worker_env

CLI = [sys.executable, "-m", "agentstream", "dataset", "export"]

CONFIG = """
[streams]
app_id = "{app_id}"
grace_s = 0.2
idle_timeout_s = 1.5
session_timeout_s = 3

[[credit]]
agent = "traj-*"
strategy = "final"
level = "trajectory"

[[credit]]
agent = "*"
strategy = "final"
"""

SYSTEM = {"role": "system", "content": "Use the calculator."}
USER = {"role": "user", "content": [{"type": "text", "text": "Compute "}, {"type": "text", "text": "2+3."}]}
TOOL_CALL = [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"e\":\"2+3\"}"}}]
ASKED = {"role": "assistant", "content": None, "tool_calls": TOOL_CALL}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "5"}
ANSWER = {"role": "assistant", "content": "It is 5.", "tool_calls": None}

# (rollout, agent, final reward, [(prompt ids, response ids, policy version, input messages, output messages)])
TOOL_LOOP = [([1, 2, 3], [5, 6, 7], 4, [SYSTEM, USER], [ASKED]),
             ([1, 2, 3, 5, 6, 7, 40, 41], [8, 9], 3, [SYSTEM, USER, ASKED, RESULT], [ANSWER]),
             ([1, 2, 3, 5, 66, 7, 40, 41, 8, 9, 42], [10], 4, [SYSTEM, USER, ASKED, RESULT, ANSWER], [ANSWER])]
ROLLOUTS = [
    ("loop-1", "traj-tools", 1.0, TOOL_LOOP),
    ("loop-2", "traj-tools", 0.0, TOOL_LOOP),
    *[(f"chat-{i}", "chat", reward, [([20 + i, 21], [30 + i], version, [USER], [ANSWER]),
                                    ([20 + i, 21, 30 + i, 22], [31, 32 + i], version, [USER, ANSWER, USER], [ANSWER])])
      for i, reward, version in ((1, 0.25, 1), (2, 0.5, 2), (3, 0.75, 2))],
]


def rollout_items(rollout_id: str, agent: str, reward: float, calls: list) -> list[tuple[bytes, bytes]]:
    """STARTED, one batch of LLM spans (messages as the proxy records them) and the reward, SUCCEEDED."""
    t0 = now_us()
    common = {"rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1", "agent_name": agent, "task_id": "t",
              "group_id": None, "model": "m", "kind": "LLM", "name": "chat m", "status": "OK"}
    spans = [{**common, "span_id": f"{rollout_id}-llm{i}", "start_time_us": t0 + 10 * i, "end_time_us": t0 + 10 * i + 5,
              "policy_version": version, "prompt_token_ids": prompt, "response_token_ids": response,
              "response_logprobs": [-0.1 * (j + 1) for j in range(len(response))],
              "attributes": {"gen_ai.input.messages": json.dumps(inputs),
                             "gen_ai.output.messages": json.dumps(outputs)}}
             for i, (prompt, response, version, inputs, outputs) in enumerate(calls)]
    spans.append({**common, "span_id": f"{rollout_id}-r", "kind": "REWARD", "name": "reward", "model": None,
                  "start_time_us": t0 + 100, "end_time_us": t0 + 100, "reward": reward})
    started, _, ended = rollout_records(rollout_id, agent=agent, task="t", llm_at=[])
    return [(rollout_id.encode(), value) for value in (started, SpanBatchEncoder().encode_span_batch(spans), ended)]


@pytest.fixture(scope="module")
def traces(tmp_path_factory, stack, stack_config):
    """Five rollouts credited by a real worker: two trajectory level (merged and split samples), three per call."""
    tmp_path = tmp_path_factory.mktemp("dataset")
    tag = uuid.uuid4().hex[:8]
    database = f"dataset_{tag}"
    env = worker_env(tmp_path, stack, f"d{tag}.", database, CONFIG.format(app_id=f"dataset-{tag}"))
    create_topics(env)
    worker = Worker(env, env_path(env) / "worker.log").start()  # it creates the database
    client = connect(stack_config.clickhouse, stack.clickhouse_url, database=database)
    try:
        items = [item for rollout in ROLLOUTS for item in rollout_items(*rollout)]
        asyncio.run(produce(stack.bootstrap_servers, f"d{tag}.spans", items))
        wait_for(lambda: client.query("SELECT count() FROM transitions FINAL").result_rows[0][0], 60, equals=10,
                 what="ten transitions (2 x 2 trajectory samples, 3 x 2 per call)")
        wait_for(lambda: client.query("SELECT countIf(status = 'SUCCEEDED') FROM rollouts FINAL").result_rows[0][0],
                 60, equals=5, what="five succeeded rollouts")
    finally:
        worker.stop()
    yield env, client, tmp_path
    client.command(f"DROP DATABASE IF EXISTS {database}")
    client.close()


def export(env: dict, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, str(out), *args], env=env, capture_output=True, text=True, timeout=120, check=False)


def exported_ids(env: dict, out: Path, *args: str) -> list[str]:
    result = export(env, out, *args)
    assert result.returncode == 0, result.stderr
    return [row["rollout_id"] for row in read_rows(out)]


def table_counts(client) -> list[int]:
    return [client.query(f"SELECT count() FROM {table}").result_rows[0][0] for table in ("rollouts", "spans",
                                                                                          "transitions")]


def test_export_loads_in_datasets_with_the_token_ids_of_spans_and_transitions(traces, monkeypatch):
    env, client, tmp_path = traces
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    jsonl, paged, parquet = tmp_path / "all.jsonl", tmp_path / "paged.jsonl", tmp_path / "all.parquet"
    for out, args in ((jsonl, ()), (paged, ("--batch-rollouts", "2")), (parquet, ("--batch-rollouts", "2"))):
        result = export(env, out, *args)
        assert result.returncode == 0, result.stderr
        assert f"wrote 5 rollouts (12 LLM calls, 10 samples) to {out}" in result.stderr
        assert not list(out.parent.glob(f"{out.name}.*.partial"))
    assert paged.read_bytes() == jsonl.read_bytes()  # pages of 2 write what one page writes
    assert pq.ParquetFile(parquet).metadata.num_row_groups == 3  # one row group per page: 2 + 2 + 1
    assert list(read_rows(parquet)) == list(read_rows(jsonl))

    calls = {}
    for rollout_id, *call in client.query(
            "SELECT rollout_id, span_id, policy_version, prompt_token_ids, response_token_ids, response_logprobs "
            "FROM spans FINAL WHERE kind = 'LLM' ORDER BY start_time, span_id").result_rows:
        calls.setdefault(rollout_id, []).append(call)
    samples = {}
    for rollout_id, *sample in client.query(
            "SELECT rollout_id, transition_id, policy_version, prompt_token_ids, response_token_ids, loss_mask, "
            "reward, advantage, merged_calls FROM transitions FINAL ORDER BY step_index").result_rows:
        samples.setdefault(rollout_id, []).append(sample)
    rewards = dict(client.query("SELECT rollout_id, final_reward FROM rollouts FINAL").result_rows)

    cache = tmp_path / "hf-cache"
    for kind, path in (("json", jsonl), ("parquet", parquet)):
        loaded = datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=str(cache))
        assert loaded.num_rows == 5 and loaded["rollout_id"] == sorted(rewards)
        for row in loaded:
            rollout_id = row["rollout_id"]
            assert row["reward"] == rewards[rollout_id] and row["status"] == "SUCCEEDED"
            assert [[c[k] for k in ("span_id", "policy_version", "prompt_token_ids", "response_token_ids",
                                    "response_logprobs")] for c in row["calls"]] == calls[rollout_id]
            assert [[s[k] for k in ("transition_id", "policy_version", "prompt_token_ids", "response_token_ids",
                                    "loss_mask", "reward", "advantage", "merged_calls")]
                    for s in row["samples"]] == samples[rollout_id]
        loop = next(row for row in loaded if row["rollout_id"] == "loop-1")
        assert loop["policy_versions"] == [3, 4] and loop["end_time"].endswith("Z")
        merged = loop["samples"][0]  # the first two calls extend each other: one sample, a mask over the tool result
        assert merged["merged_calls"] == 2 and merged["loss_mask"] == [True] * 3 + [False] * 2 + [True] * 2
        assert [m["role"] for m in loop["messages"]] == ["system", "user", "assistant", "tool", "assistant",
                                                         "assistant"]
        assert loop["messages"][1]["content"] == "Compute 2+3."  # text parts joined
        assert json.loads(loop["messages"][2]["tool_calls"]) == TOOL_CALL and loop["messages"][2]["content"] is None
        assert loop["messages"][3]["tool_call_id"] == "c1" and loop["messages"][-1]["content"] == "It is 5."


@pytest.mark.parametrize("args, expected", [
    (("--agent", "chat", "--min-reward", "0.3"), ["chat-2", "chat-3"]),
    (("--agent", "traj-tools", "--agent", "chat", "--max-reward", "0.25"), ["chat-1", "loop-2"]),
    (("--version", "2"), ["chat-2", "chat-3"]),
    (("--min-version", "3"), ["loop-1", "loop-2"]),  # a rollout counts under its newest version
    (("--where", "total_reward > 0.3 AND has(policy_versions, 2)"), ["chat-2", "chat-3"]),
    (("--where", "rollout_id IN (SELECT rollout_id FROM transitions WHERE merged_calls = 2)", "--limit", "1"),
     ["loop-1"]),
    (("--since", "1h", "--until", "2999-01-01T00:00:00Z", "--limit", "3", "--batch-rollouts", "2"),
     ["chat-1", "chat-2", "chat-3"]),
])
def test_filters_select_what_they_say(traces, args, expected):
    env, _, tmp_path = traces
    assert exported_ids(env, tmp_path / "filtered.jsonl", *args) == expected


@pytest.mark.parametrize("where, refusal", [
    ("1) ; DROP TABLE rollouts; SELECT (1", "closes a parenthesis the clause did not open"),
    ("1; DROP TABLE rollouts", "';' is refused"),
    ("rollout_id IN (INSERT INTO rollouts SELECT * FROM rollouts)", "ClickHouse refused the clause: Code: 62"),
    ("1 IN (SELECT 1 FROM url('http://127.0.0.1:9/x', 'CSV', 'a Int32'))", "table functions (url) are refused"),
    ("length(file('/etc/passwd')) > 0", "functions that read files (file) are refused"),  # a scalar, any readonly
    ("substring(FILE('/etc/hostname'), 1, 1) = 'v'", "functions that read files (file) are refused"),
    ("status = ", "ClickHouse refused the clause: Code: 62"),
    ("no_such_column = 1", "ClickHouse refused the selection"),
])
def test_a_hostile_or_malformed_where_is_refused_and_changes_nothing(traces, where, refusal):
    env, client, tmp_path = traces
    before = table_counts(client)
    out = tmp_path / "hostile.parquet"
    result = export(env, out, "--where", where)
    assert result.returncode == 1 and refusal in result.stderr and repr(where) in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.*.partial"))
    assert table_counts(client) == before


@pytest.mark.parametrize("name", ["empty.jsonl.gz", "empty.parquet"])
def test_an_empty_selection_writes_a_valid_empty_file(traces, name):
    env, _, tmp_path = traces
    out = tmp_path / name
    result = export(env, out, "--agent", "nobody")
    assert result.returncode == 0 and "no rollouts matched" in result.stderr
    assert list(read_rows(out)) == []
    if name.endswith(".parquet"):
        assert pq.read_table(out).num_rows == 0
