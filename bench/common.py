"""Shared pieces of the benchmark scripts: JSON-line output, a private stack, a realistic 1 KB LLM span."""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from infra.config import Config, load_config
from infra.machine import child_processes, process_cpu_seconds, process_label
from infra.processes import free_port
from infra.stack import Endpoints, Stack

VOCABULARY = 49152  # SmolLM2's


def emit(bench: str, metric: str, value: float | None, unit: str, **extra: Any) -> None:
    """One figure as a JSON line: {"bench", "metric", "value", "unit", ...}; a figure not reached is null."""
    print(json.dumps({"bench": bench, "metric": metric, "value": None if value is None else round(value, 3),
                      "unit": unit, **extra}), flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def private_stack(**environ: str) -> Iterator[tuple[Config, Endpoints]]:
    """A broker and ClickHouse of our own on free loopback ports, stopped afterwards."""
    with tempfile.TemporaryDirectory(prefix="agentstream-bench-") as home:
        config = load_config(environ={"AGENTSTREAM_HOME": home, "AGENTSTREAM_BROKER_PORT": str(free_port()),
                                      "AGENTSTREAM_CLICKHOUSE_PORT": str(free_port()), **environ})
        stack = Stack(config)
        endpoints = stack.up(progress=lambda line: None)
        try:
            yield config, endpoints
        finally:
            stack.down(progress=lambda line: None)


def llm_span(rng: random.Random, index: int, rollout_id: str = "", start_us: int = 1_732_200_000_000_000) -> dict:
    """An LLM call of about 1 KB encoded: 100 prompt and 100 response token ids, 100 logprobs, gen_ai attributes."""
    return {
        "span_id": f"{rollout_id}-{index:08x}", "rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1",
        "parent_id": None, "name": "chat SmolLM2-135M-Instruct", "kind": "LLM",
        "start_time_us": start_us + index * 1000, "end_time_us": start_us + index * 1000 + 250_000, "status": "OK",
        "agent_name": "math-agent", "task_id": f"task-{index % 7473:05d}", "model": "SmolLM2-135M-Instruct",
        "attributes": {"gen_ai.system": "agentstream", "gen_ai.request.model": "SmolLM2-135M-Instruct",
                       "gen_ai.request.temperature": "1.0", "gen_ai.usage.output_tokens": "100"},
        "prompt_token_ids": [int(VOCABULARY ** rng.random()) for _ in range(100)],
        "response_token_ids": [int(VOCABULARY ** rng.random()) for _ in range(100)],
        "response_logprobs": [-rng.expovariate(2.0) for _ in range(100)],
        "policy_version": 3,
    }


class CpuShare(threading.Thread):
    """Each process's share of the machine while a block runs: this process and every descendant, by label.

    CPU counters are read every ``interval_s``; a process that exits between two readings keeps what
    was last read of it, so short-lived processes are undercounted by at most one interval. A process
    already running at the start counts from its counter then; one started later counts all its CPU.
    """

    def __init__(self, label: str, cores: int, interval_s: float = 2.0) -> None:
        super().__init__(name="cpu-share", daemon=True)
        self.label, self.cores, self.interval_s = label, cores, interval_s
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.began = self.ended = 0.0
        self.stopping = threading.Event()

    def __enter__(self) -> CpuShare:
        self.began = time.monotonic()
        self._read(baseline=True)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.join()
        self._read()
        self.ended = time.monotonic()

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self._read()

    def _read(self, baseline: bool = False) -> None:
        me = os.getpid()
        for pid in (me, *child_processes(me)):
            seconds = process_cpu_seconds(pid)
            label = self.label if pid == me else process_label(pid)
            if seconds is None or label is None:
                continue
            self.first.setdefault(pid, seconds if baseline else 0.0)
            self.last[pid] = (label, seconds)

    def seconds_by_label(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for pid, (label, seconds) in self.last.items():
            totals[label] += seconds - self.first[pid]
        return dict(totals)

    def shares(self) -> dict[str, float]:
        """CPU seconds per label over (wall seconds x cores), largest first; 1.0 is every core busy."""
        available = max(self.ended - self.began, 1e-9) * self.cores
        ordered = sorted(self.seconds_by_label().items(), key=lambda item: -item[1])
        return {label: round(seconds / available, 3) for label, seconds in ordered}

