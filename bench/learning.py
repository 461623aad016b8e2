"""Learning speed: time until held-out greedy accuracy reaches the target, streamed pipeline vs a plain loop.

Ours is the demo itself (``agentstream.demo.run_demo``): runners, proxy, dev server, Kafka,
streams, trainer and hot swap as separate processes, generation overlapping training. The
peer is the plain synchronous loop on the same machine, model, task split and hyperparameters:
generate 4 prompts x 8 samples, group-normalise rewards, skip groups without spread, one
optimizer step with the same loss code, repeat. Both are evaluated on the same held-out tasks
every ``demo.eval_every_s`` of wall time (the clock keeps running during evaluation) and stop at
the target or after ``demo.seconds``. Prints JSON lines; ``ratio`` = ours / peer (lower is better).
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from dataclasses import replace

import torch

from agentstream.demo import run_demo
from bench.common import emit
from examples import arithmetic
from infra.config import Config, load_config
from models import LoadedModel, eos_token_ids
from serving.generation import BatchRequest, SamplingParams, generate_batch
from serving.tool_format import render_prompt, renders_tools
from streams.credit import GroupNormalized
from trainer.batching import Batch, Counts, Sample
from trainer.policy import build_policy
from trainer.step import train_step


def peer_run(config: Config) -> tuple[float | None, list[tuple[float, int, float]]]:
    """The plain loop; returns (seconds to the target or None, [(seconds, version, accuracy)])."""
    demo = config.demo
    trainer = replace(config.trainer, model="smollm2", threads=2, lr=demo.lr,
                      temperature=1.0)
    policy = build_policy(trainer)
    tokenizer, model = policy.tokenizer, policy.model
    eos = eos_token_ids(LoadedModel(model, tokenizer, policy.name, policy.dtype))
    pad = tokenizer.pad_token_id or 0
    native_tools = renders_tools(tokenizer)

    def prompt(task: dict) -> list[int]:
        return render_prompt(tokenizer, [{"role": "user", "content": task["prompt"]}], None, native_tools)

    def generate(tasks: list[dict], params: SamplingParams):
        model.eval()
        return generate_batch(model, tokenizer, [BatchRequest(prompt(t), params) for t in tasks], eos, pad,
                              autocast=policy.precision.autocast)

    def accuracy(tasks: list[dict]) -> float:
        results = generate(tasks, SamplingParams(max_tokens=arithmetic.MAX_TOKENS, temperature=0.0))
        return sum(arithmetic.reward(r[0].text, t["answer"]) for r, t in zip(results, tasks, strict=True)) / len(tasks)

    train, heldout = arithmetic.split()
    rng = random.Random(0)
    grpo = GroupNormalized()
    evaluations = [(0.0, 0, accuracy(heldout))]
    started = time.monotonic()
    next_eval, version, order = started + demo.eval_every_s, 0, []
    while time.monotonic() - started < demo.training_seconds:
        if len(order) < demo.prompts_per_wave:
            order += rng.sample(train, len(train))
        tasks, order = order[:demo.prompts_per_wave], order[demo.prompts_per_wave:]
        sampling = SamplingParams(max_tokens=arithmetic.MAX_TOKENS, temperature=1.0, n=demo.group_size, logprobs=True)
        samples = []
        for task, sequences in zip(tasks, generate(tasks, sampling), strict=True):
            rewards = [arithmetic.reward(s.text, task["answer"]) for s in sequences]
            if not grpo.informative(rewards):
                continue
            for sequence, reward, advantage in zip(sequences, rewards, grpo.advantages(rewards), strict=True):
                samples.append(Sample(uuid.uuid4().hex, uuid.uuid4().hex, version, prompt(task), sequence.token_ids,
                                      [entry.logprob for entry in sequence.logprobs], reward, advantage))
        if samples:
            train_step(policy, Batch(samples, version, Counts()), trainer)
            version += 1
        if time.monotonic() >= next_eval:
            evaluations.append((round(time.monotonic() - started, 1), version, accuracy(heldout)))
            print(f"peer: {evaluations[-1][0]:.0f} s, v{version}, held-out {evaluations[-1][2]:.1%}", flush=True)
            next_eval = time.monotonic() + demo.eval_every_s
            if evaluations[-1][2] >= demo.target:
                return evaluations[-1][0], evaluations
    return None, evaluations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=None, help="Cap on each run's training time.")
    parser.add_argument("--eval-every", type=float, default=90.0, help="Seconds between held-out evaluations.")
    parser.add_argument("--only", choices=["ours", "peer"], default=None)
    args = parser.parse_args()
    config = load_config()
    config = replace(config, demo=replace(config.demo, stop_at_target=True, quick=False, output_dir="bench-output",
                                          eval_every_s=args.eval_every,
                                          report_path="bench-output/learning-report.json",
                                          **({"seconds": args.seconds} if args.seconds else {})))
    report = peer_result = None
    if args.only in (None, "ours"):
        report = run_demo(config)
    if args.only in (None, "peer"):
        torch.set_num_threads(2)
        peer_result = peer_run(config)
    if peer_result is not None:
        peer, evaluations = peer_result
        emit("learning", "peer_time_to_85pct_s", peer, "s",
             reached=peer is not None, heldout_before=evaluations[0][2], heldout_after=evaluations[-1][2],
             policy_versions=evaluations[-1][1], peer="plain synchronous generate-then-train loop")
    if report is not None:
        ours = report.time_to_target_s
        extra = {}
        if peer_result is not None and peer_result[0] is not None and ours is not None:
            extra = {"peer": peer_result[0], "ratio": round(ours / peer_result[0], 3)}
        emit("learning", "time_to_85pct_s", ours, "s", reached=ours is not None,
             heldout_before=report.heldout_before, heldout_after=report.heldout_after,
             policy_versions=report.policy_versions, **extra)

if __name__ == "__main__":
    main()
