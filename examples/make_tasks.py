"""Write the arithmetic task files: ``python -m examples.make_tasks [--out DIR]``.

``examples/tasks/arithmetic-train.jsonl`` and ``arithmetic-heldout.jsonl`` hold
``examples.arithmetic.split()``, one ``{"id", "prompt", "answer"}`` object per line, ready for
``agentstream enqueue``. The split is seeded, so the files are the same on every run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from examples.arithmetic import split

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
FILES = {"train": "arithmetic-train.jsonl", "heldout": "arithmetic-heldout.jsonl"}


def render(tasks: list[dict]) -> str:
    """One JSON object per line."""
    return "".join(json.dumps(task, separators=(", ", ": ")) + "\n" for task in tasks)


def write(out: Path = TASKS_DIR) -> dict[str, Path]:
    """Write both files into ``out``; returns their paths by split name."""
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = split()
    paths = {}
    for name, tasks in (("train", train), ("heldout", heldout)):
        paths[name] = out / FILES[name]
        paths[name].write_text(render(tasks))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.make_tasks",
                                     description="Write the arithmetic train and held-out task files (JSONL).")
    parser.add_argument("--out", type=Path, default=TASKS_DIR, help=f"output folder (default: {TASKS_DIR})")
    args = parser.parse_args(argv)
    for name, path in write(args.out).items():
        print(f"{name}: {len(path.read_text().splitlines())} tasks -> {path}")


if __name__ == "__main__":
    main()
