"""The CLI's own checks of its options, before anything starts, and how a command fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentstream.cli import main
from agentstream.cli.errors import EXIT_PERMANENT, EXIT_RETRIABLE, MissingExtra, requires_extra
from agentstream.infra.processes import free_port
from agentstream.pipeline.runner.pool import AgentLoadError

ROOT = Path(__file__).resolve().parents[3]


def test_the_model_server_options_refuse_what_the_config_refuses():
    for args, problem in [(["proxy", "--upstream", "gpu-a:8000"], "not an http:// or https:// URL: gpu-a:8000"),
                          (["hotswap", "--model", "m", "--server", "http://a:1", "--server", "http://a:1/"],
                           "a model server named twice: http://a:1"),
                          (["deployments", "--server", "ftp://a"], "not an http:// or https:// URL: ftp://a")]:
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and problem in result.output, result.output


def test_sft_refuses_a_malformed_or_empty_dataset_before_loading_the_model_or_reaching_clickhouse(tmp_path):
    bad, empty = tmp_path / "bad.jsonl", tmp_path / "empty.jsonl"
    bad.write_text('{"rollout_id": "r"}\n')
    empty.write_text("")
    model = ["--model", str(tmp_path / "no-such-model")]  # loading it, or waiting for ClickHouse, would fail otherwise
    result = CliRunner().invoke(main, ["sft", "--dataset", str(bad), *model])
    assert result.exit_code == 1 and f"{bad}: row 1: " in result.output, result.output
    result = CliRunner().invoke(main, ["sft", "--dataset", str(empty), *model])
    assert result.exit_code == 1 and "no rollouts: no checkpoint written" in result.output, result.output


def test_dataset_export_refuses_a_reward_bound_that_is_not_finite(tmp_path):
    for value in ("nan", "inf", "-inf"):
        result = CliRunner().invoke(main, ["dataset", "export", str(tmp_path / "d.jsonl"), "--min-reward", value])
        assert result.exit_code == 2 and "must be a finite number" in result.output, result.output
    result = CliRunner().invoke(main, ["dataset", "export", str(tmp_path / "d.jsonl"), "--since", "99999999d"])
    assert result.exit_code == 2 and "reaches before year 1" in result.output, result.output
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- how a command fails (agentstream/cli/errors.py)


def test_a_permanent_error_is_one_line_and_status_1(tmp_path):
    result = CliRunner().invoke(main, ["--config", str(tmp_path / "missing.toml"), "config"])
    assert result.exit_code == EXIT_PERMANENT == 1, result.output
    assert result.stderr == f"error: config file {tmp_path / 'missing.toml'} does not exist\n" and result.stdout == ""


def test_a_retriable_error_is_one_line_and_status_75(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, ["sql", "SELECT 1"], env={"CLICKHOUSE_URL": url,
                                                               "AGENTSTREAM_HOME": str(tmp_path)})
    assert result.exit_code == EXIT_RETRIABLE == 75, result.output
    assert result.stderr == f"error: cannot reach ClickHouse at {url}: connection refused\n" and result.stdout == ""


def test_each_command_s_product_errors_reach_the_one_handler(tmp_path, monkeypatch):
    """A command catches nothing itself: what deploy raises, permanent or retriable, is the group's to report."""
    from agentstream.deploy import manual
    from agentstream.deploy.deployments import DeploymentError
    from agentstream.infra.kafka import KafkaUnreachable

    env = {"AGENTSTREAM_HOME": str(tmp_path)}
    for error, status in [(DeploymentError("model 'm' has no checkpoint v7"), 1),
                          (KafkaUnreachable("no broker answered at 127.0.0.1:9"), 75)]:
        def fail(*args, error=error):
            raise error

        monkeypatch.setattr(manual, "promote_by_hand", fail)
        result = CliRunner().invoke(main, ["promote", "--model", "m", "--version", "7"], env=env)
        assert result.exit_code == status, result.output
        kind = "KafkaUnreachable: " if isinstance(error, KafkaUnreachable) else ""  # a Kafka error names its class
        assert result.stderr == f"error: {kind}{error}\n"


def test_an_error_that_is_no_product_error_is_not_swallowed(tmp_path, monkeypatch):
    from agentstream.deploy import manual

    def bug(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(manual, "roll_back_by_hand", bug)
    result = CliRunner().invoke(main, ["rollback", "--model", "m"], env={"AGENTSTREAM_HOME": str(tmp_path)})
    assert result.exit_code == 1 and isinstance(result.exception, KeyError) and "error:" not in result.stderr


# ---------------------------------------------------------------- optional extras


def test_a_missing_extra_names_the_pip_command(tmp_path):
    """Without torch (blocked in a fresh interpreter), each command that needs it says which pip install to run."""
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("")
    program = f"""
import sys
sys.modules["torch"] = None  # what an install without the [train] extra sees
from click.testing import CliRunner
from agentstream.cli import main
for args in (["serve-model"], ["train-worker"], ["sft", "--dataset", {str(dataset)!r}], ["demo"]):
    result = CliRunner().invoke(main, args)
    print(result.exit_code, result.stderr, end="")
"""
    ran = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    assert ran.stdout.splitlines() == [
        "1 error: serve-model needs torch: pip install 'agentstream[train]'",
        "1 error: train-worker needs torch: pip install 'agentstream[train]'",
        "1 error: sft needs torch: pip install 'agentstream[train]'",
        "1 error: demo needs torch: pip install 'agentstream[train,examples]'"], ran.stderr


def test_the_extra_guard_turns_only_a_missing_dependency_into_missing_extra():
    wanted = r"^serve-model needs no_such_dependency_xyz: pip install 'agentstream\[train\]'$"
    with pytest.raises(MissingExtra, match=wanted) as caught, requires_extra("train", "serve-model"):
        import no_such_dependency_xyz  # noqa: F401
    assert caught.value.retriable is False and caught.value.extra == "train"
    with pytest.raises(ModuleNotFoundError, match=r"agentstream\.no_such_module"), requires_extra("train", "x"):
        import agentstream.no_such_module  # noqa: F401  (our own module missing: a bug, not an extra)
    with pytest.raises(AgentLoadError), requires_extra("train", "x"):
        raise AgentLoadError("cannot import 'agent'")
