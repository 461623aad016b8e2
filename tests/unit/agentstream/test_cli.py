"""The CLI's own checks of its options, before anything starts."""

from __future__ import annotations

from click.testing import CliRunner

from agentstream.cli import main


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
