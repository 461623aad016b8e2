"""`agentstream dataset export` speed and memory: rollouts/s and the command's peak RSS over synthetic rollouts.

Starts the embedded ClickHouse front (``python -m agentstream.stack.chserver``) on a fresh data folder, creates
the product's tables, inserts ``--rollouts`` synthetic rollouts (three LLM calls each, a growing
multi-turn prompt of 200-400 token ids, 50 response ids with logprobs, chat messages in the span
attributes, and one trajectory-level sample), then runs the CLI export to Parquet and to JSON
Lines at each size, timing it (the wall time includes the command's start-up, about 1 s here;
``export_s`` is its own figure) and reading its peak RSS from the kernel (``wait4``). Peak RSS
that stays flat as the selection grows is the streaming bound. Prints JSON lines.

Run: ``python -m bench.dataset_export [--rollouts 2000 8000] [--batch-rollouts 500]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from agentstream.infra.clickhouse import connect, migrate
from agentstream.infra.config import load_config
from agentstream.stack.machine import calibrate
from bench.common import VOCABULARY, clickhouse_front, emit

BENCH = "dataset_export"
DATABASE = "bench_dataset"
SPAN_COLUMNS = ["span_id", "rollout_id", "attempt_id", "name", "kind", "start_time", "end_time", "status",
                "agent_name", "task_id", "model", "policy_version", "attributes", "prompt_token_ids",
                "response_token_ids", "response_logprobs"]
ROLLOUT_COLUMNS = ["rollout_id", "attempt_id", "task_id", "agent_name", "model", "status", "start_time", "end_time",
                   "span_count", "llm_calls", "final_reward", "total_reward", "policy_versions", "updated_at"]
TRANSITION_COLUMNS = ["transition_id", "rollout_id", "span_id", "agent_name", "model", "policy_version", "step_index",
                      "prompt_token_ids", "response_token_ids", "behaviour_logprobs", "loss_mask", "merged_calls",
                      "reward", "return_value", "advantage", "created_at"]


def tokens(rng: random.Random, count: int) -> list[int]:
    return [int(VOCABULARY ** rng.random()) for _ in range(count)]


def insert_rollouts(client, first: int, count: int, rng: random.Random) -> None:
    """``count`` rollouts from number ``first``: three calls each, extending one prompt, and one merged sample."""
    start = datetime(2026, 11, 27, tzinfo=UTC)
    spans, rollouts, transitions = [], [], []
    for number in range(first, first + count):
        rollout_id = f"r{number:08d}"
        at = start + timedelta(seconds=number)
        prompt, messages = tokens(rng, 200), [{"role": "user", "content": f"Task {number}: compute something."}]
        for call in range(3):
            response = tokens(rng, 50)
            reply = {"role": "assistant", "content": f"step {call} " + "x" * 200, "tool_calls": None}
            spans.append([f"{rollout_id}-{call}", rollout_id, f"{rollout_id}-1", "chat m", "LLM",
                          at + timedelta(milliseconds=call), at + timedelta(milliseconds=call + 1), "OK", "bench",
                          f"t{number}", "m", 1, {"gen_ai.input.messages": json.dumps(messages),
                                                 "gen_ai.output.messages": json.dumps([reply])},
                          prompt, response, [-rng.expovariate(2.0) for _ in response]])
            messages = [*messages, reply, {"role": "tool", "tool_call_id": f"c{call}", "content": "42"}]
            prompt = [*prompt, *response, *tokens(rng, 50)]
        reward = float(number % 2)
        rollouts.append([rollout_id, f"{rollout_id}-1", f"t{number}", "bench", "m", "SUCCEEDED", at,
                         at + timedelta(seconds=1), 4, 3, reward, reward, [1], at + timedelta(seconds=2)])
        response = prompt[200:]
        transitions.append([f"{rollout_id}-x", rollout_id, f"{rollout_id}-0", "bench", "m", 1, 0, prompt[:200],
                            response, [-0.5] * len(response), [True] * len(response), 3, reward, reward, reward - 0.5,
                            at + timedelta(seconds=2)])
    client.insert(f"{DATABASE}.spans", spans, column_names=SPAN_COLUMNS)
    client.insert(f"{DATABASE}.rollouts", rollouts, column_names=ROLLOUT_COLUMNS)
    client.insert(f"{DATABASE}.transitions", transitions, column_names=TRANSITION_COLUMNS)


def export(url: str, folder: Path, out: Path, batch: int) -> tuple[float, float, str]:
    """Run the CLI export once: seconds, peak RSS in MiB, and its last stderr line."""
    config = folder / "agentstream.toml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
    env.update({"CLICKHOUSE_URL": url, "CLICKHOUSE_DATABASE": DATABASE, "AGENTSTREAM_CONFIG": str(config),
                "AGENTSTREAM_HOME": str(folder / "home")})
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "agentstream", "dataset", "export", str(out),
                                "--batch-rollouts", str(batch)], env=env, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"export failed:\n{stderr}")
    return seconds, usage.ru_maxrss / 1024, stderr.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, nargs="+", default=[2000, 8000], help="selection sizes, ascending")
    parser.add_argument("--batch-rollouts", type=int, default=500, help="the export's page size")
    args = parser.parse_args(argv)
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    rng = random.Random(39)
    with tempfile.TemporaryDirectory(prefix="agentstream-bench-") as name, clickhouse_front(Path(name) / "ch") as url:
        folder = Path(name)
        client = connect(load_config(environ={}).clickhouse, url)
        migrate(client, DATABASE)
        inserted = 0
        for size in sorted(args.rollouts):
            while inserted < size:
                chunk = min(1000, size - inserted)
                insert_rollouts(client, inserted, chunk, rng)
                inserted += chunk
            for suffix in ("parquet", "jsonl"):
                out = folder / f"export-{size}.{suffix}"
                seconds, rss_mib, last = export(url, folder, out, args.batch_rollouts)
                own = re.search(r" in ([0-9.]+)s$", last)  # the command's own time, without its start-up
                extra = {"rollouts": size, "format": suffix, "batch_rollouts": args.batch_rollouts,
                         "file_mib": round(out.stat().st_size / 2**20, 1)}
                emit(BENCH, "rollouts_per_s", size / seconds, "rollouts/s", seconds=round(seconds, 2),
                     export_s=float(own.group(1)) if own else None, **extra)
                emit(BENCH, "peak_rss", rss_mib, "MiB", **extra)
                print(last, file=sys.stderr)
                out.unlink()
        client.close()

if __name__ == "__main__":
    main()
