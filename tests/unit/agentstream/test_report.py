"""The report's durations: parsed from text like 1h30m and written back."""

from __future__ import annotations

import pytest

from agentstream.report import format_duration, parse_duration


def test_durations():
    assert [parse_duration(text) for text in ("30s", "1m", "1h30m", "2d", "90", " 1w ")] == [
        30, 60, 5400, 172800, 90, 604800]
    for text in ("", "0m", "1y", "h", "1h-"):
        with pytest.raises(ValueError):
            parse_duration(text)
    assert [format_duration(s) for s in (60, 90, 3600, 86400)] == ["1m", "90s", "1h", "1d"]
