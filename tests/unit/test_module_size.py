"""No product module grows past about 500 lines unless its docstring says why it is one module.

A module that long usually holds two jobs; the few that do not say so (``... on purpose: <why>``), so a
newcomer reads the reason before the code and a module that grows past the limit by accident fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("agentstream", "pipeline", "serving", "models", "schemas", "streams", "trainer", "deploy", "stack", "infra",
         "examples")
LIMIT = 500
SLACK = 80
"""About 500: a module may pass the limit by this many lines before it must say why."""


def long_modules_without_a_reason(root: Path = ROOT) -> list[str]:
    found = []
    for room in ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            if room == "agentstream" and path.relative_to(root / room).parts[0] in ROOMS:
                continue  # agentstream/<room> is the room's own folder, walked as the room
            source = path.read_text()
            lines = source.count("\n")
            if lines > LIMIT + SLACK and "on purpose" not in (ast.get_docstring(ast.parse(source)) or ""):
                found.append(f"{path.relative_to(root)} ({lines} lines)")
    return found


def test_long_modules_say_why():
    assert long_modules_without_a_reason() == []


def test_the_check_sees_a_long_module(tmp_path):
    for room in ROOMS:
        (tmp_path / room).mkdir()
    (tmp_path / "trainer" / "long.py").write_text('"""Two jobs."""\n' + "x = 1\n" * (LIMIT + SLACK))
    (tmp_path / "trainer" / "reasoned.py").write_text('"""One job, long on purpose: a reason."""\n' + "x = 1\n" * 900)
    (tmp_path / "trainer" / "short.py").write_text('"""Short."""\n' + "x = 1\n" * LIMIT)
    assert long_modules_without_a_reason(tmp_path) == [f"trainer/long.py ({LIMIT + SLACK + 1} lines)"]
