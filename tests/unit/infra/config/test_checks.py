"""The one way a section states its checks: each rule passes what it allows and names what it refused."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from agentstream.infra.config import ConfigError
from agentstream.infra.config.checks import Checks, spelled


@dataclass
class Values:
    mode: str = "auto"
    count: int = 1
    share: float = 0.5
    port: int = 8080
    url: str | None = None
    device: str = "cpu"


def refusal(**values: Any) -> str:
    """The message of the first rule that fails for a section holding ``values``."""
    check = Checks("part", Values(**values))
    with pytest.raises(ConfigError) as refused:
        check.one_of("mode", ("auto", "on", "off"))
        check.at_least("count", 1, " (0: never)")
        check.within("share", "(0, 1]")
        check.port("port", zero="any free port")
        check.http_url("url")
        check.device("device")
        check.finite("share")
        check.above("count", 0)
        check.that(values.get("count") != 7, "count is 7: part needs another")
    return str(refused.value)


def test_a_section_within_every_rule_passes():
    check = Checks("part", Values())
    check.one_of("mode", ("auto", "on"))
    check.at_least("count", 1)
    check.above("count", 0)
    check.within("share", "[0.5, 0.5]")
    check.port("port")
    check.port("port", zero="any")
    check.http_url("url")
    check.device("device")
    check.finite("share")
    check.that(True, "never said")
    for fine in (Values(port=0, url="https://h"), Values(device="cuda:1", share=1.0), Values(device="auto")):
        again = Checks("part", fine)
        again.port("port", zero="any free port")
        again.http_url("url")
        again.device("device")
        again.within("share", "(0, 1]")


@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "yes"}, "part.mode must be auto, on or off, got 'yes'"),
    ({"count": 0}, "part.count must be >= 1 (0: never), got 0"),
    ({"share": 0.0}, "part.share must be within (0, 1], got 0.0"),
    ({"share": 1.5}, "part.share must be within (0, 1], got 1.5"),
    ({"share": math.nan}, "part.share must be within (0, 1], got nan"),
    ({"port": 70000}, "part.port must be a TCP port (1-65535) or 0 (any free port), got 70000"),
    ({"port": -1}, "part.port must be a TCP port (1-65535) or 0 (any free port), got -1"),
    ({"url": "ftp://h"}, "part.url must start with http:// or https://, got 'ftp://h'"),
    ({"device": "tpu"}, "part.device must be auto, cpu or cuda[:N], got 'tpu'"),
    ({"count": 7}, "part.count is 7: part needs another"),
])
def test_the_first_failing_rule_names_the_value_what_it_must_be_and_what_it_got(values, message):
    assert refusal(**values) == message


def test_bounds_refuse_what_no_comparison_admits():
    for rule in ("at_least", "above"):
        with pytest.raises(ConfigError, match=r"part\.share must be >? ?.*got nan"):
            getattr(Checks("part", Values(share=math.nan)), rule)("share", 0)
    with pytest.raises(ConfigError, match="must be a finite number, got inf"):
        Checks("part", Values(share=math.inf)).finite("share")
    with pytest.raises(ConfigError, match=r"must be a TCP port \(1-65535\), got 0"):
        Checks("part", Values(port=0)).port("port")


def test_an_interval_is_written_as_the_message_shows_it():
    check = Checks("part", Values(share=1.0))
    check.within("share", "[0, 1]")
    with pytest.raises(ConfigError, match=r"within \(0\.5, 1\)"):
        check.within("share", "(0.5, 1)")
    with pytest.raises(ValueError, match="not an interval"):
        check.within("share", "0 to 1")


def test_values_are_spelled_as_a_sentence_lists_them():
    assert spelled(["a"]) == "a"
    assert spelled(("dev", "vllm")) == "dev or vllm"
    assert spelled(("auto", "float32", "bfloat16")) == "auto, float32 or bfloat16"
