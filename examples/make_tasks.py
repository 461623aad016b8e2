"""Write the shipped task files: ``python -m agentstream.examples.make_tasks [--out DIR]``.

``examples/tasks/{agent}-train.jsonl`` and ``{agent}-heldout.jsonl`` hold each example agent's
seeded split (``examples.arithmetic.split()``, ``examples.calculator_agent.split()``,
``examples.word_problems.split()``), one
``{"id", "prompt", "answer"}`` object per line, ready for ``agentstream enqueue``. The splits are
seeded, so the files are the same on every run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from agentstream.examples import arithmetic, calculator_agent, word_problems

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
SPLITS: dict[str, Callable[[], tuple[list[dict], list[dict]]]] = {
    "arithmetic": arithmetic.split, "calculator": calculator_agent.split, "word-problems": word_problems.split}


def render(tasks: list[dict]) -> str:
    """One JSON object per line."""
    return "".join(json.dumps(task, separators=(", ", ": ")) + "\n" for task in tasks)


def write(out: Path = TASKS_DIR) -> dict[str, Path]:
    """Write every agent's two files into ``out``; returns their paths by file stem."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for agent, split in SPLITS.items():
        train, heldout = split()
        for name, tasks in (("train", train), ("heldout", heldout)):
            path = paths[f"{agent}-{name}"] = out / f"{agent}-{name}.jsonl"
            path.write_text(render(tasks))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agentstream.examples.make_tasks",
                                     description="Write the example agents' train and held-out task files (JSONL).")
    parser.add_argument("--out", type=Path, default=TASKS_DIR, help=f"output folder (default: {TASKS_DIR})")
    args = parser.parse_args(argv)
    for name, path in write(args.out).items():
        print(f"{name}: {len(path.read_text().splitlines())} tasks -> {path}")


if __name__ == "__main__":
    main()
