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
