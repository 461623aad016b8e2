"""The demos' settings: defined with the demos, read by infra's loader as ``[demo]`` like its own sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentstream.demo.settings import DemoConfig
from agentstream.infra.config import ENVIRONMENT, SECTIONS, Config, ConfigError, add_section, describe, dump_toml
from agentstream.infra.config import load_config as load


def test_the_configuration_holds_the_demo_settings_in_their_place():
    assert SECTIONS["demo"] is DemoConfig and Config().demo == DemoConfig()
    assert list(SECTIONS).index("demo") == list(SECTIONS).index("deploy") + 1  # Config's order, as before
    assert list(describe(load(environ={}))).index("demo") == list(SECTIONS).index("demo")
    assert (ENVIRONMENT["DEMO_QUICK"], ENVIRONMENT["DEMO_SECONDS"]) == (("demo", "quick"), ("demo", "seconds"))


def test_the_file_and_the_environment_set_them(tmp_path: Path):
    path = tmp_path / "agentstream.toml"
    path.write_text('[demo]\nheldout_tasks = 160\nseconds = 300\n')
    demo = load(path, environ={"DEMO_SECONDS": "120", "DEMO_QUICK": "1"}).demo
    assert (demo.heldout_tasks, demo.seconds, demo.quick, demo.training_seconds) == (160, 120.0, True, 240.0)
    assert load(environ={}).demo == DemoConfig()


def test_they_reach_a_child_process_through_the_dumped_file(tmp_path: Path):
    config = dataclasses.replace(load(environ={}), demo=DemoConfig(online_rate=3.5, dtype="bfloat16"))
    path = tmp_path / "child.toml"
    path.write_text(dump_toml(config))
    assert load(path, environ={}) == config
    assert describe(config)["demo"]["online_rate"] == 3.5


@pytest.mark.parametrize(("content", "message"), [
    ("[demo]\nheldout_tasks = 400\n", r"demo\.heldout_tasks must be between 1 and 399"),
    ("[demo]\nheldout = 100\n", r"\[demo\]: unknown key\(s\) \['heldout'\]"),
    ("[demo]\ngroup_size = 'x'\n", r"demo\.group_size: cannot use 'x'"),
    ("[demo]\nonline_confidence = 1\n", r"demo\.online_confidence must be within \(0\.5, 1\), got 1"),
])
def test_bad_demo_settings_are_clear_errors(tmp_path: Path, content: str, message: str):
    path = tmp_path / "agentstream.toml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load(path, environ={})


def test_a_section_is_added_only_where_config_has_its_field():
    @dataclass(frozen=True)
    class Other:
        x: int = 0

    with pytest.raises(ValueError, match="no field for a section 'elsewhere'"):
        add_section("elsewhere", Other, {})
    with pytest.raises(ValueError, match="no field for a section 'credit'"):
        add_section("credit", Other, {})
    with pytest.raises(ValueError, match=r"section 'demo' is agentstream\.demo\.settings\.DemoConfig already"):
        add_section("demo", Other, {})
    add_section("demo", DemoConfig, {"DEMO_QUICK": "quick"})  # the same class again: nothing changes
    assert SECTIONS["demo"] is DemoConfig and list(SECTIONS).count("demo") == 1
