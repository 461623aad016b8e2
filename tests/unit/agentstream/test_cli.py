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


def test_dataset_export_refuses_a_reward_bound_that_is_not_finite(tmp_path):
    for value in ("nan", "inf", "-inf"):
        result = CliRunner().invoke(main, ["dataset", "export", str(tmp_path / "d.jsonl"), "--min-reward", value])
        assert result.exit_code == 2 and "must be a finite number" in result.output, result.output
    result = CliRunner().invoke(main, ["dataset", "export", str(tmp_path / "d.jsonl"), "--since", "99999999d"])
    assert result.exit_code == 2 and "reaches before year 1" in result.output, result.output
    assert not any(tmp_path.iterdir())
