"""The product's console breaks no printed line: not in a pipe or a file, not on a 40-column terminal."""

from __future__ import annotations

import io
import os
import re
import sys

import pytest
from rich.table import Table

from agentstream.console import RULE_WIDTH, product_console
from agentstream.demo.training import EXPLORE_COMMAND
from agentstream.stack.machine import Calibration

pytestmark = pytest.mark.unit

# The CPU whose name made the demo's calibration line wrap at "calibration: a fixed" (issue 48).
MACHINE = Calibration(cpu_model="Intel(R) Xeon(R) Processor @ 2.50GHz", cores=2, python_loop_s=0.25,
                      numpy_matmul_s=0.4)
TITLE = "agentstream demo: calculator (quick, 240 s of training, warm-started on 64 demonstrations)"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def demo_lines(console) -> list[str]:
    """What the demo prints that a user reads whole or pastes; each goes out as one ``print``."""
    lines = [f"machine: {MACHINE.describe()} (docs/demo.md's figures name theirs: a slower machine learns "
             "slower in the same minutes)",
             "broker      tansu pid 4242 on 127.0.0.1:39093 (log /home/someone/.agentstream/demo/0123abcd/broker.log)",
             f"explore the run: {EXPLORE_COMMAND}"]
    console.rule(TITLE)
    for line in lines:
        console.print(line)
    return lines


def printed_through_a_pipe(monkeypatch, draw) -> str:
    """What ``draw(console)`` prints on the console the demo makes for itself, its standard output a pipe."""
    reading, writing = os.pipe()
    with os.fdopen(reading, encoding="utf-8") as source, os.fdopen(writing, "w", encoding="utf-8") as sink:
        monkeypatch.setattr(sys, "stdout", sink)
        console = product_console()  # what run_demo makes when it is given none
        assert not console.is_terminal
        draw(console)
        sink.flush()
        monkeypatch.undo()
        sink.close()
        return source.read()


def test_off_a_terminal_every_line_goes_out_whole_at_any_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    printed: list[str] = []
    out = printed_through_a_pipe(monkeypatch, lambda console: printed.extend(demo_lines(console)))
    lines = out.splitlines()
    for line in printed:
        assert line in lines, f"{line!r} was broken:\n{out}"
    (rule,) = [line for line in lines if TITLE in line]
    assert rule.startswith("─") and rule.endswith("─") and len(rule) <= max(RULE_WIDTH, len(TITLE) + 6)
    assert "\x1b[" not in out  # no colours in a log file


def test_off_a_terminal_a_table_is_never_cut(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    cell = "s3://agentstream/checkpoints/SmolLM2-135M-Instruct/v00017/adapter_model.safetensors"

    def draw(console) -> None:
        table = Table(title="deployment decisions")
        for column in ("version", "action", "reason"):
            table.add_column(column)
        table.add_row("17", "CANDIDATE", cell)
        console.print(table)

    out = printed_through_a_pipe(monkeypatch, draw)
    assert cell in out and "…" not in out


def test_on_a_40_column_terminal_a_command_is_one_line_and_a_rule_keeps_its_title(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    target = io.StringIO()
    console = product_console(target, force_terminal=True)
    assert console.is_terminal and console.width == 40
    printed = demo_lines(console)
    lines = ANSI.sub("", target.getvalue()).splitlines()
    for line in printed:  # the terminal folds them on screen; a copy pastes as one line
        assert line in lines
    assert TITLE in lines and "…" not in "".join(lines)
    assert all(len(line) == 40 for line in lines if line.startswith("─"))
