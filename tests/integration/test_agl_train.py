"""Agent Lightning agents, unchanged, through `agentstream train` on the tiny model.

The agents (tests/support/agl_agents.py) are written as Agent Lightning's documentation writes
them. The built-in path runs them on ``agentstream.agl`` (Agent Lightning absent: part of
``make test``); with ``AGENTSTREAM_TEST_AGL=1`` (``make test-agl``) the same run happens in the side
environment ``.venv-agl`` where the real ``agentlightning==0.3.0`` is installed, so its
``@rollout``, ``LitAgent`` and ``emit_*`` are the ones that run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.streams_harness import worker_env

ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".venv-agl" / "bin" / "python"
STYLES = ("rollout", "rollout_async", "llm_rollout", "litagent")
GROUP = 2

CONFIG = """
[topics]
partitions = 1

[streams]
grace_s = 0.2
session_timeout_s = 3

[trainer]
device = "cpu"
threads = 1
lr = 0.003
batch_transitions = 8
batch_tokens = 0
batch_wait_s = 2
checkpoint_every_steps = 1
session_timeout_s = 3

[agl]
temperature = 1.0
"""

ENVIRONMENTS = [
    pytest.param(sys.executable, "agentstream.agl", id="built-in"),
    pytest.param(str(SIDE_PYTHON), "agentlightning", id="agentlightning-0.3.0", marks=pytest.mark.agl),
]


@pytest.mark.parametrize(("python", "package"), ENVIRONMENTS)
def test_agent_lightning_agents_train_unchanged(python, package, tmp_path, stack, clickhouse):
    if package == "agentlightning" and not SIDE_PYTHON.exists():
        pytest.fail(f"{SIDE_PYTHON} is missing: `make test-agl` builds it")
    tag = uuid.uuid4().hex[:8]
    database = f"agl_{tag}"
    env = worker_env(tmp_path, stack, f"agl{tag}.", database, CONFIG)
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # Agent Lightning's import otherwise waits on the network
    tasks = tmp_path / "tasks.csv"  # Agent Lightning datasets are often CSV; every value arrives as a string
    tasks.write_text("id,style,prompt\n" + "".join(f"{style}-{n},{style},Task {n}: write letters.\n"
                                                     for style in STYLES for n in range(2)))
    val = tmp_path / "val.json"
    val.write_text(json.dumps([{"id": f"val-{style}", "style": style, "prompt": "Write letters."}
                               for style in STYLES]))
    result = subprocess.run(
        [python, "-m", "agentstream", "train", "--agent", "tests.support.agl_agents:AllStyles", "--tasks", str(tasks),
         "--val-tasks", str(val), "--model", "tiny", "--group-size", str(GROUP), "--concurrency", "8"],
        env=env, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trained = len(STYLES) * 2 * GROUP
    assert f"done: {trained} rollouts" in result.stdout
    assert "evaluation (AllStyles-eval, 4 tasks): mean reward" in result.stdout

    rows = clickhouse.query(
        f"SELECT task_id, status, final_reward, reward_dimensions FROM {database}.rollouts FINAL "
        "WHERE agent_name = 'AllStyles'").result_rows
    assert len(rows) == trained and {status for _, status, _, _ in rows} == {"SUCCEEDED"}
    assert all(reward is not None and 0.0 <= reward <= 1.0 for _, _, reward, _ in rows), rows
    dimensions = [dims for task, _, _, dims in rows if task.startswith("rollout_async-")]
    assert len(dimensions) == 2 * GROUP and all(set(d) == {"letters", "length"} for d in dimensions)

    messages = [text for (text,) in clickhouse.query(
        f"SELECT DISTINCT attributes['message'] FROM {database}.spans WHERE kind = 'MESSAGE'").result_rows]
    assert {text.split(" on ")[0] for text in messages} == {"rollout_llm", "rollout_async_llm", "llm_rollout_agent",
                                                            "LetterAgent"}
    assert all(f" on {package}" in text for text in messages), messages
    assert any("(val, " in text for text in messages) and any("(train, " in text for text in messages), messages
    llm_calls = clickhouse.query(f"SELECT count(), countIf(length(response_token_ids) > 0) FROM {database}.spans "
                                 "WHERE kind = 'LLM' AND agent_name = 'AllStyles'").result_rows[0]
    assert llm_calls[0] == llm_calls[1] == trained

    transitions = dict(clickhouse.query(
        f"SELECT agent_name, count() FROM {database}.transitions FINAL GROUP BY agent_name").result_rows)
    assert transitions.get("AllStyles", 0) >= 1 and "AllStyles-eval" not in transitions
    evaluated = clickhouse.query(f"SELECT count() FROM {database}.rollouts FINAL WHERE agent_name = 'AllStyles-eval' "
                                 "AND status = 'SUCCEEDED'").result_rows[0][0]
    assert evaluated == 2 * len(STYLES)  # before and after training
    clickhouse.command(f"DROP DATABASE IF EXISTS {database}")
