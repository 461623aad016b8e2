"""The demo's training step: seconds per SmolLM2 step on GRPO waves, as the streamed trainer takes them.

Each wave holds 1-4 groups of 8 answers (10-32 tokens) to arithmetic prompts, the way the demo
trains; the step runs on ``--threads`` torch threads (1: the demo's trainer, beside the model
server's thread) in the demo's compute dtype (``[demo] dtype``). Prints one JSON line per wave
size, ``step_seconds`` (the mean of ``--rounds`` steps, after one warm-up step), and the machine's
calibration first.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import replace

import torch

from agentstream.demo.training import compute_dtype
from agentstream.examples import arithmetic
from agentstream.infra.config import load_config
from agentstream.serving.tool_format import renders_tools
from agentstream.stack.machine import calibrate
from agentstream.trainer.batching import Batch, Counts, Sample
from agentstream.trainer.policy import build_policy
from agentstream.trainer.step import train_step
from bench.common import emit
from bench.learning import task_prompt

GROUP = 8


def wave(tokenizer, tasks: list[dict], rng: random.Random) -> Batch:
    """One wave: GROUP answers of random tokens per task, half of them rewarded (advantage +-1)."""
    native_tools = renders_tools(tokenizer)
    samples = []
    for task in tasks:
        prompt = task_prompt(tokenizer, native_tools, task)
        for index in range(GROUP):
            length = rng.randint(10, arithmetic.MAX_TOKENS)
            samples.append(Sample(f"{task['id']}-{index}-{rng.random()}", "bench", 0, prompt,
                                  [rng.randrange(100, 5000) for _ in range(length)], [-3.0] * length, 1.0,
                                  1.0 if index % 2 else -1.0))
    return Batch(samples, 0, Counts())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="Torch threads (1: as the demo's trainer runs).")
    parser.add_argument("--rounds", type=int, default=3, help="Steps measured per wave size.")
    args = parser.parse_args()
    calibration = calibrate()
    emit("step", "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    torch.set_num_threads(args.threads)
    config = load_config()
    dtype = compute_dtype(config)
    settings = replace(config.trainer, model="smollm2", threads=args.threads, dtype=dtype, lr=1e-7, temperature=1.0)
    policy = build_policy(settings)
    train, _ = arithmetic.split(heldout=config.demo.heldout_tasks)
    rng = random.Random(0)
    train_step(policy, wave(policy.tokenizer, rng.sample(train, 1), rng), settings)  # warm-up
    for groups in (1, 2, 3, 4):
        seconds = [train_step(policy, wave(policy.tokenizer, rng.sample(train, groups), rng), settings).seconds
                   for _ in range(args.rounds)]
        emit("step", "step_seconds", statistics.mean(seconds), "s", transitions=groups * GROUP, dtype=dtype,
             threads=args.threads, each=[round(s, 3) for s in seconds])


if __name__ == "__main__":
    main()
