"""`agentstream demo` (what `make demo` runs), shortened to 45 s of training, on its own stack home and ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from agentstream.demo.training import EXPLORE_COMMAND
from tests.conftest import stack_environment
from tests.support.wandb_offline import read_offline_run

STOP_GRACE_S = 45.0
"""How long a demo past its time has to stop its stack after SIGTERM (each test's own limit leaves room for it)."""


def flat(out: str) -> str:
    """Printed text with each run of whitespace one space: assertions on what it says, not on where lines break."""
    return " ".join(out.split())


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line or environment mentions ``text`` (the demo's children carry its config path)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def run_demo(args: list[str], env: dict[str, str], cwd: Path, home: Path,
             timeout_s: float) -> subprocess.CompletedProcess:
    """``agentstream demo ARGS`` to its end; past ``timeout_s`` it is asked to stop (SIGTERM: it stops what it
    started), and whatever of its stack outlives that is killed, so a slow run fails alone instead of leaving
    a model server and a trainer to starve the tests after it (its children run in sessions of their own)."""
    demo = subprocess.Popen([sys.executable, "-m", "agentstream", "demo", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = demo.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        demo.send_signal(signal.SIGTERM)
        try:
            out, err = demo.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            demo.kill()
            out, err = demo.communicate()
        left = processes_mentioning(str(home))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"the demo ran past {timeout_s:.0f} s (stopped; {len(left)} of its processes killed after)\n"
                    f"{out[-4000:]}{err[-4000:]}")
    return subprocess.CompletedProcess(demo.args, demo.returncode, out, err)


@pytest.mark.timeout(600)
def test_the_demo_trains_evaluates_reports_and_stops_everything(tmp_path, monkeypatch):
    home = tmp_path / "home"
    env = {**stack_environment(home), "COLUMNS": "40"}  # a narrow terminal's width, with the output a pipe
    (tmp_path / "agentstream.toml").write_text('[demo]\neval_every_s = 25\n[tracking]\nmlflow_uri = "file:./mlruns"\n'
                                               'wandb_mode = "offline"\nwandb_dir = "wandb-runs"\n')
    result = run_demo(["--seconds", "45"], env, tmp_path, home, timeout_s=540)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert f"explore the run: {EXPLORE_COMMAND}" in lines, "the command to paste is printed whole, on one line"
    assert any(line.startswith("machine: ") and line.endswith("in the same minutes)") for line in lines)
    out = flat(result.stdout)
    assert "held-out before training:" in out and "held-out after training:" in out
    assert "dashboard: http://127.0.0.1:" in out  # up while the demo ran
    assert " rollouts (" in out and "policy v" in out  # the progress lines
    assert "calibration: a fixed Python loop" in out  # so figures from different machines compare
    report = json.loads((tmp_path / "demo-report.json").read_text())
    evaluations = report["evaluations"]
    assert len(evaluations) >= 3 and all(e["total"] == 64 for e in evaluations)  # before, during, after
    assert report["heldout_before"] == evaluations[0]["accuracy"] and evaluations[0]["policy_version"] == 0
    assert 0.15 < report["heldout_before"] < 0.5  # SmolLM2-135M-Instruct's greedy level on the held-out split
    assert report["heldout_after"] == evaluations[-1]["accuracy"]
    assert report["policy_versions"] >= 1 and report["train_steps"] == report["policy_versions"]
    assert 45 <= report["training_seconds"] < 60  # RL had its whole budget ...
    assert report["evaluation_seconds"] > 0 and all(25 <= e["seconds"] < 46 for e in evaluations[1:-1])  # ... beside
    assert report["seconds"] > report["training_seconds"] + report["evaluation_seconds"]  # evaluations off its clock
    assert evaluations[-1]["policy_version"] == report["policy_versions"]  # the server runs the newest checkpoint
    assert report["rollouts"] >= 32 and report["spans"] > report["rollouts"]
    assert report["reward_per_version"] and report["reward_per_version"][0]["policy_version"] == 0
    assert report["machine"]["cores"] >= 1 and report["machine"]["python_loop_s"] > 0 and report["machine"]["cpu_model"]
    assert (tmp_path / "demo-output" / "reward_per_version.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "demo-output" / "report.md").read_text()
    assert "held-out greedy accuracy" in markdown and "python_loop_s" in markdown
    assert report["objective"] == "policy_gradient" and "trained by RL (policy gradient)" in markdown
    assert "stopped (pid" in out and not list((home / "run").glob("*.json"))
    assert processes_mentioning(str(home)) == [], "processes the demo started are still running"
    tracked_in_mlflow_and_wandb(tmp_path, report, out, monkeypatch)


def tracked_in_mlflow_and_wandb(folder: Path, report: dict, out: str, monkeypatch) -> None:
    """The demo's run as MLflow's client reads it from ``folder/mlruns``, and its W&B offline run."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked
    client = MlflowClient(tracking_uri=(folder / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("agentstream").experiment_id])
    assert run.info.run_name == "SmolLM2-135M-Instruct v0→" and run.data.params["trainer.model"] == "smollm2"
    assert f"heldout_accuracy logged into MLflow run {run.info.run_id}" in out
    steps = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in steps] == list(range(1, report["train_steps"] + 1))
    versions = report["policy_versions"]
    assert len(client.list_artifacts(run.info.run_id, "checkpoints")) == versions  # every version's manifest
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "heldout_accuracy")] == [
        (e["policy_version"], e["accuracy"]) for e in report["evaluations"]]
    (offline,) = (folder / "wandb-runs" / "wandb").glob("offline-run-*")
    history = [row for row in read_offline_run(offline).history if "loss" in row]
    assert [row["loss"] for row in history] == pytest.approx([m.value for m in steps])


@pytest.mark.scenario
@pytest.mark.timeout(780)
def test_the_calculator_demo_on_the_agents_sdk_warm_starts_then_trains_multi_step_rollouts(tmp_path):
    """The calculator agent as written on the OpenAI Agents SDK (the Responses API through the proxy): its
    demonstrations rendered with the tools the SDK sent, then RL on its own rollouts."""
    home = tmp_path / "home"
    env = stack_environment(home)
    (tmp_path / "agentstream.toml").write_text("[demo]\neval_every_s = 600\nheldout_tasks = 8\n"
                                               "warm_start_demonstrations = 32\n")
    result = run_demo(["--agent", "calculator", "--framework", "agents-sdk", "--seconds", "90"], env, tmp_path, home,
                      timeout_s=720)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = flat(result.stdout)
    assert "calculator on agents-sdk" in out and "calculator_agents_sdk:solve" in out
    assert "warm start: 32 demonstrations (64 LLM calls) published" in out and "warm start done in" in out
    assert "demonstrations use the plain agent's calculator tool" not in out  # the SDK's own tools were read
    assert "held-out after the warm start:" in out and "held-out after training:" in out
    assert "T=0.5, 2 rollouts per task" in out
    report = json.loads((tmp_path / "demo-report.json").read_text())
    assert report["agent"] == "calculator" and report["framework"] == "agents-sdk"
    assert report["heldout_warm_start"] is not None
    before, warmed = report["evaluations"][:2]
    assert before["policy_version"] == 0 and before["total"] == 16  # two rollouts per task, at T=0.5
    assert warmed["policy_version"] >= 1  # the server held weights trained on the demonstrations
    assert report["warm_start_seconds"] > 0 and report["llm_calls_per_rollout"] >= 1
    assert report["heldout_llm_calls_per_rollout"] >= 1  # the final evaluation's 16 rollouts, all written
    assert report["training_seconds"] >= 90  # the warm start, however long it took, is off RL's clock
    markdown = (tmp_path / "demo-output" / "report.md").read_text()
    assert "after the warm start" in markdown and "LLM calls per train rollout" in markdown
    assert "LLM calls per held-out rollout at the end (T=0.5, 2 rollouts per task)" in markdown
    assert processes_mentioning(str(home)) == [], "processes the demo started are still running"


@pytest.mark.scenario
@pytest.mark.timeout(600)
def test_the_online_demo_serves_users_gates_a_candidate_reports_and_stops_everything(tmp_path):
    home = tmp_path / "home"
    env = stack_environment(home)
    (tmp_path / "agentstream.toml").write_text(
        "[demo]\nonline_batch = 8\nonline_steps_per_checkpoint = 1\nonline_eval_tasks = 8\nonline_rate = 1.0\n"
        "online_feedback_max_delay_s = 10\n")
    result = run_demo(["--online", "--seconds", "150"], env, tmp_path, home, timeout_s=540)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = flat(result.stdout)
    assert "requests (0 failed), last minute" in out and "live success" in out
    assert "dashboard: http://127.0.0.1:" in out
    report = json.loads((tmp_path / "online-report.json").read_text())
    assert report["requests"] >= 30 and report["failed_requests"] == 0
    assert report["feedback_failed"] == 0, "every user's feedback URL carried its rollout's token"
    assert report["feedback_sent"] > 0 and report["per_minute"] and report["per_version"][0]["version"] == 0
    assert 0 < report["latency_ms"]["p50"] <= report["latency_ms"]["p99"]
    assert report["settings"]["rate_per_s"] == 1.0 and report["machine"]["python_loop_s"] > 0
    # two replicas behind the proxy, each loading the candidate from the object store into its own cache
    assert report["settings"]["model_servers"] == 2 and report["settings"]["checkpoints"].startswith("s3://agentstream/")
    caches = [home / "online" / run.name / name / "checkpoint-cache" for run in (home / "online").iterdir()
              for name in ("model-server-0", "model-server-1")]
    assert all(any(cache.rglob("checkpoint.json")) for cache in caches), caches
    assert report["cpu_share"]["agentstream serve-model"] > 0 and report["cpu_share"]["agentstream train-worker"] > 0
    assert "machine: " in out and "CPU while users asked" in out
    actions = [row["action"] for row in report["deployments"]]
    assert actions and actions[0] == "CANDIDATE"  # the first checkpoint reached the gate, and its row ClickHouse
    assert (tmp_path / "demo-output" / "online.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "stopped (pid" in out and not list((home / "run").glob("*.json"))
    assert processes_mentioning(str(home)) == [], "processes the online demo started are still running"
