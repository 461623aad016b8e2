"""`agentstream report` run as a user runs it, against realistic rows in a real ClickHouse (its own database)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agentstream.infra.clickhouse import migrate
from agentstream.infra.processes import free_port

pytestmark = pytest.mark.clickhouse_only  # no broker: the Apache Kafka pass leaves these out

CLI = [sys.executable, "-m", "agentstream"]

SPAN_COLUMNS = ["span_id", "rollout_id", "attempt_id", "parent_id", "name", "kind", "start_time", "end_time", "status",
                "agent_name", "model", "policy_version", "attributes", "prompt_token_ids", "response_token_ids",
                "reward"]
ROLLOUT_COLUMNS = ["rollout_id", "attempt_id", "agent_name", "model", "status", "start_time", "end_time", "span_count",
                   "llm_calls", "final_reward", "total_reward", "policy_versions", "updated_at"]
STEP_COLUMNS = ["model", "step", "policy_version", "loss", "reward_mean", "kl", "staleness_mean", "staleness_max",
                "dropped_stale", "transitions", "tokens", "created_at"]


def cli_env(tmp_path: Path, clickhouse_url: str, database: str) -> dict[str, str]:
    """A user's environment pointing the CLI at one ClickHouse database, with no config file of its own."""
    config = tmp_path / "agentstream.toml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
    env.update({"CLICKHOUSE_URL": clickhouse_url, "CLICKHOUSE_DATABASE": database,
                "AGENTSTREAM_CONFIG": str(config), "AGENTSTREAM_HOME": str(tmp_path / "home")})
    return env


def report(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "report", *args], env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def report_json(env: dict, *args: str) -> dict:
    result = report(env, "--format", "json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), as ClickHouse's quantile() does."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@pytest.fixture
def database(clickhouse):
    name = f"report_{uuid.uuid4().hex[:10]}"
    migrate(clickhouse, name)
    yield name
    clickhouse.command(f"DROP DATABASE IF EXISTS {name}")


# The newest activity lies in minute BASE + 3; the old rollout lies two days before.
NOW = datetime.now(UTC)
BASE = datetime.fromtimestamp(int(NOW.timestamp()) // 60 * 60, UTC) - timedelta(minutes=10)
OLD = NOW - timedelta(days=2)

# (rollout, agent, model, status, final reward, policy versions, start)
ROLLOUTS = [
    ("r1", "solver", "policy-a", "SUCCEEDED", 0.0, [1], BASE),
    ("r2", "solver", "policy-a", "FAILED", None, [1], BASE),
    ("r3", "solver", "policy-a", "SUCCEEDED", 1.0, [1, 2], BASE + timedelta(minutes=1)),  # hot swap mid-rollout
    ("r4", "solver", "policy-a", "SUCCEEDED", 0.5, [2], BASE + timedelta(minutes=1)),
    ("r5", "solver", "policy-a", "SUCCEEDED", 0.75, [2], BASE + timedelta(minutes=3)),
    ("r8", "solver", "policy-a", "AWAITING_REWARD", None, [2], BASE + timedelta(minutes=3)),
    ("r6", "chat", "policy-b", "COMPLETED", 0.25, [], BASE),
    ("r7", "chat", "policy-b", "EXPIRED", None, [3], BASE + timedelta(minutes=1)),
    ("r9", "solver", "policy-a", "SUCCEEDED", 1.0, [1], OLD),
]
DURATIONS_A = [10.0, 20.0, 30.0, 40.0, 100.0]  # ms, policy-a's LLM calls


def rollout_row(rollout_id, agent, model, status, reward, versions, start, updated_offset_s=1.0):
    return [rollout_id, f"{rollout_id}-a1", agent, model, status, start, start + timedelta(seconds=20), 3,
            len(versions), reward, reward or 0.0, versions, start + timedelta(seconds=20 + updated_offset_s)]


def span_row(span_id, rollout_id, kind, start, duration_ms, *, agent="solver", model="", version=None, status="OK",
             prompt=(), response=(), attributes=None, reward=None):
    return [span_id, rollout_id, f"{rollout_id}-a1", "", f"{kind.lower()} {model}".strip(), kind, start,
            start + timedelta(milliseconds=duration_ms), status, agent, model, version, attributes or {},
            list(prompt), list(response), reward]


def step_row(step, version, transitions, lag_mean, lag_max, dropped, reward, loss=0.1, kl=0.01):
    return ["policy-a", step, version, loss, reward, kl, lag_mean, lag_max, dropped, transitions, transitions * 50,
            BASE + timedelta(seconds=step)]


@pytest.fixture
def populated(clickhouse, database, tmp_path, stack):
    """Rollouts, spans and train steps as the stream processors and the trainer write them, with replays."""
    rollouts = [rollout_row(*r) for r in ROLLOUTS]
    # r5 first waited for its reward: that older row must be replaced (ReplacingMergeTree(updated_at) + FINAL).
    rollouts.append(rollout_row("r5", "solver", "policy-a", "AWAITING_REWARD", None, [2], BASE + timedelta(minutes=3),
                                updated_offset_s=0.0))
    clickhouse.insert(f"{database}.rollouts", rollouts, column_names=ROLLOUT_COLUMNS)

    offsets_s = [5, 10, 65, 70, 190]  # minute 0: two calls, minute 1: two, minute 3: one
    spans = []
    for index, (duration, offset) in enumerate(zip(DURATIONS_A, offsets_s, strict=True)):
        spans.append(span_row(f"a-llm-{index}", f"r{index + 1}", "LLM", BASE + timedelta(seconds=offset), duration,
                              model="policy-a", version=1 if index < 2 else 2, status="ERROR" if index == 4 else "OK",
                              prompt=range(10 + index), response=range(4)))
    spans.append(span_row("b-llm-0", "r6", "LLM", BASE + timedelta(seconds=20), 500.0, agent="chat", model="policy-b",
                          attributes={"gen_ai.usage.input_tokens": "7", "gen_ai.usage.output_tokens": "3"}))
    spans.append(span_row("a-tool-0", "r1", "TOOL", BASE + timedelta(seconds=6), 2.0))
    spans.append(span_row("a-reward-0", "r1", "REWARD", BASE + timedelta(seconds=7), 0.0, reward=0.0))
    clickhouse.insert(f"{database}.spans", spans, column_names=SPAN_COLUMNS)
    clickhouse.insert(f"{database}.spans", spans[:1], column_names=SPAN_COLUMNS)  # a replay after a crash

    steps = [step_row(1, 1, 10, 0.0, 0, 0, 0.2), step_row(2, 1, 30, 1.0, 2, 3, 0.6),
             step_row(3, 2, 20, 0.5, 1, 0, 0.4), step_row(4, 2, 20, 1.5, 3, 5, 0.8)]
    clickhouse.insert(f"{database}.train_steps", steps, column_names=STEP_COLUMNS)
    clickhouse.insert(f"{database}.train_steps", steps[-1:], column_names=STEP_COLUMNS)  # a replay
    return cli_env(tmp_path, stack.clickhouse_url, database)


def by(rows: list[dict], *keys: str) -> dict:
    return {tuple(row[k] for k in keys) if len(keys) > 1 else row[keys[0]]: row for row in rows}


def test_reward_by_policy_version_and_agent(populated):
    rows = by(report_json(populated)["reward_by_policy_version"], "agent", "policy_version")
    assert set(rows) == {("chat", None), ("chat", 3), ("solver", 1), ("solver", 2)}
    v1 = rows["solver", 1]  # r1 (0.0), r2 (failed, no reward), r9 (1.0, two days old)
    assert (v1["rollouts"], v1["rewarded"], v1["mixed_versions"]) == (3, 2, 0)
    assert v1["mean_reward"] == pytest.approx(0.5) and v1["success_rate"] == pytest.approx(2 / 3)
    v2 = rows["solver", 2]  # r3 (mixed 1+2: counts under 2), r4, r5 (replaced row), r8 (awaiting: not an outcome)
    assert (v2["rollouts"], v2["rewarded"], v2["mixed_versions"]) == (4, 3, 1)
    assert v2["mean_reward"] == pytest.approx((1.0 + 0.5 + 0.75) / 3)
    assert v2["success_rate"] == pytest.approx(1.0) and v2["max_reward"] == 1.0
    assert rows["chat", None]["mean_reward"] == pytest.approx(0.25)
    assert rows["chat", 3]["mean_reward"] is None and rows["chat", 3]["success_rate"] == 0.0

    recent = by(report_json(populated, "--since", "1h")["reward_by_policy_version"], "agent", "policy_version")
    assert recent["solver", 1]["rollouts"] == 2 and recent["solver", 1]["mean_reward"] == pytest.approx(0.0)
    only_chat = report_json(populated, "--agent", "chat")["reward_by_policy_version"]
    assert {row["agent"] for row in only_chat} == {"chat"}


def test_llm_tokens_and_latency_percentiles_by_model(populated):
    rows = by(report_json(populated)["llm_by_model"], "model")
    assert list(rows) == ["policy-a", "policy-b"], "the replayed span is counted once, tool/reward spans never"
    a = rows["policy-a"]
    assert (a["calls"], a["errors"]) == (5, 1)
    assert a["prompt_tokens_total"] == sum(10 + i for i in range(5)) and a["completion_tokens_total"] == 20
    for column, q in (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99)):
        assert a[column] == pytest.approx(percentile(DURATIONS_A, q), rel=1e-6), column
    assert a["p90_ms"] == pytest.approx(76.0) and a["max_ms"] == pytest.approx(100.0)
    b = rows["policy-b"]  # no token ids (a hosted API): the usage attributes count instead
    assert (b["calls"], b["prompt_tokens_total"], b["completion_tokens_total"]) == (1, 7, 3)
    assert b["p50_ms"] == pytest.approx(500.0)
    assert [row["model"] for row in report_json(populated, "--model", "policy-b")["llm_by_model"]] == ["policy-b"]


def test_rollout_status_counts(populated):
    rows = by(report_json(populated)["rollout_status"], "agent", "status")
    counts = {key: row["rollouts"] for key, row in rows.items()}
    assert counts == {("solver", "SUCCEEDED"): 5, ("solver", "FAILED"): 1, ("solver", "AWAITING_REWARD"): 1,
                      ("chat", "COMPLETED"): 1, ("chat", "EXPIRED"): 1}
    assert rows["solver", "SUCCEEDED"]["share"] == pytest.approx(5 / 7)
    assert rows["chat", "EXPIRED"]["share"] == pytest.approx(0.5)
    assert rows["solver", "SUCCEEDED"]["mean_duration_s"] == pytest.approx(20.0)


def test_training_staleness_by_policy_version(populated):
    rows = by(report_json(populated)["training"], "policy_version")
    assert list(rows) == [1, 2]
    v1, v2 = rows[1], rows[2]
    assert (v1["steps"], v1["first_step"], v1["last_step"], v1["samples"]) == (2, 1, 2, 40)
    assert v1["lag_mean"] == pytest.approx((0.0 * 10 + 1.0 * 30) / 40) and v1["lag_max"] == 2
    assert v1["stale_dropped"] == 3 and v1["mean_reward"] == pytest.approx((0.2 * 10 + 0.6 * 30) / 40)
    assert v2["steps"] == 2, "the replayed step counts once"
    assert v2["lag_mean"] == pytest.approx(1.0) and (v2["lag_max"], v2["stale_dropped"]) == (3, 5)
    assert report_json(populated, "--model", "policy-b")["training"] == []


def test_throughput_buckets_end_at_the_newest_activity(populated):
    rows = report_json(populated, "--bucket", "1m", "--buckets", "5")["throughput"]

    def stamp(minutes: int) -> str:
        return (BASE + timedelta(minutes=minutes)).strftime("%Y-%m-%d %H:%M:%S")

    assert [row["bucket"] for row in rows] == [stamp(m) for m in range(-1, 4)]
    by_bucket = {row["bucket"]: row for row in rows}
    # minute 0: three LLM calls (a0, a1, b0), a tool and a reward span; r1, r2, r6 end (at +20 s)
    assert (by_bucket[stamp(0)]["spans"], by_bucket[stamp(0)]["llm_calls"]) == (5, 3)
    assert by_bucket[stamp(0)]["tokens"] == (10 + 4) + (11 + 4) + (7 + 3)
    assert by_bucket[stamp(0)]["rollouts_finished"] == 3
    assert (by_bucket[stamp(1)]["spans"], by_bucket[stamp(1)]["rollouts_finished"]) == (2, 3)  # r3, r4, r7 (expired)
    assert by_bucket[stamp(2)] == {"bucket": stamp(2), "spans": 0, "llm_calls": 0, "tokens": 0, "rollouts_finished": 0}
    assert by_bucket[stamp(3)]["spans"] == 1 and by_bucket[stamp(3)]["rollouts_finished"] == 1, "r8 awaits its reward"
    assert by_bucket[stamp(-1)]["spans"] == 0

    hourly = report_json(populated, "--bucket", "1h", "--buckets", "1")["throughput"]
    assert len(hourly) == 1 and hourly[0]["spans"] >= 1
    chat = report_json(populated, "--agent", "chat", "--buckets", "2")["throughput"]
    assert sum(row["spans"] for row in chat) == 1 and sum(row["rollouts_finished"] for row in chat) == 2


def test_table_and_csv_output(populated):
    result = report(populated)
    assert result.returncode == 0, result.stderr
    for title in ("Reward by policy version and agent", "LLM calls by model: tokens and latency",
                  "Rollout status by agent", "Training: policy lag and stale samples by policy version",
                  "Throughput per 1m bucket (UTC)"):
        assert title in result.stdout
    assert "policy-a" in result.stdout and "66.7%" in result.stdout and "(no rows)" not in result.stdout
    assert "…" not in result.stdout, "off a terminal no cell is cut"

    csv_out = report(populated, "--format", "csv")
    assert csv_out.returncode == 0, csv_out.stderr
    blocks = csv_out.stdout.split("\n\n")
    assert [block.splitlines()[0] for block in blocks] == [
        "# reward_by_policy_version", "# llm_by_model", "# rollout_status", "# training", "# throughput",
        "# sources"]
    assert blocks[1].splitlines()[1].startswith("model,calls,errors,prompt_tokens_total")


def test_empty_database_says_no_rows(database, tmp_path, stack):
    env = cli_env(tmp_path, stack.clickhouse_url, database)
    result = report(env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(no rows)") == 6
    assert report_json(env) == {"reward_by_policy_version": [], "llm_by_model": [], "rollout_status": [],
                                "training": [], "throughput": [], "sources": []}


def test_unreachable_clickhouse_is_a_one_line_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = report(cli_env(tmp_path, url, "agentstream"))
    assert result.returncode == 75 and result.stdout == "", "retriable: EX_TEMPFAIL (agentstream/cli/errors.py)"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach ClickHouse at {url}"), result.stderr
    assert time.monotonic() - started < 60


def test_missing_tables_and_bad_options_are_clear_errors(tmp_path, stack):
    result = report(cli_env(tmp_path, stack.clickhouse_url, f"nowhere_{uuid.uuid4().hex[:6]}"))
    assert result.returncode == 1 and result.stderr.startswith("error: "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    bad = report(cli_env(tmp_path, stack.clickhouse_url, "agentstream"), "--since", "yesterday")
    assert bad.returncode == 2 and "--since" in bad.stderr
