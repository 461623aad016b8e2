"""What trajectory-level samples save where successive LLM calls share a prefix: one step, trained both ways.

The same synthetic multi-call rollouts (GRPO groups sharing a system + task prompt; each rollout
``--calls`` calls of ``--response`` generated tokens with ``--tool``-token tool results between
them) are trained as transition-level samples (one per call: its prompt holds the task and every
earlier call again) and as trajectory-level samples (one per rollout: the calls merged, the tool
results masked). Both train the same tokens with the same advantages, and under ``token``
normalisation to the same gradient (``loss`` shows it); per level and model the bench prints the
tokens forwarded per step (real tokens in the micro-batches, and with padding), the step's
seconds (mean of ``--rounds`` after a warm-up) and the tokens trained per second. The machine's
calibration comes first.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from agentstream.infra.config import TrainerConfig
from agentstream.stack.machine import calibrate
from agentstream.trainer.batching import Batch, Counts, MicroBatch, PackedMicroBatch, Sample, collate
from agentstream.trainer.policy import Policy, build_policy
from agentstream.trainer.step import train_step
from bench.common import emit

BENCH = "trajectory_prefix"


def rollouts(rng: random.Random, vocabulary: int, args: argparse.Namespace) -> list[list[list[int]]]:
    """Per rollout, its segments: the prompt, then call 1, tool result 1, call 2, ... call N (token ids)."""
    def tokens(count: int) -> list[int]:
        return [rng.randrange(5, vocabulary) for _ in range(count)]

    out = []
    for _ in range(args.groups):
        prompt = tokens(args.prompt)  # the group's system + task prompt
        for _ in range(args.group_size):
            segments = [prompt]
            for call in range(args.calls):
                segments.append(tokens(args.response))
                if call < args.calls - 1:
                    segments.append(tokens(args.tool))
            out.append(segments)
    return out


def transition_level(runs: list[list[list[int]]]) -> list[Sample]:
    """One sample per call: everything before the call is its prompt."""
    samples = []
    for number, segments in enumerate(runs):
        advantage = 1.0 if number % 2 else -1.0
        for call in range(1, len(segments), 2):
            prompt = [t for segment in segments[:call] for t in segment]
            response = segments[call]
            samples.append(Sample(f"{number}-{call}", f"r{number}", 0, prompt, response, [-3.0] * len(response), 1.0,
                                  advantage))
    return samples


def trajectory_level(runs: list[list[list[int]]]) -> list[Sample]:
    """One sample per rollout: the calls and the tool results between them, the tool results masked."""
    samples = []
    for number, segments in enumerate(runs):
        response: list[int] = []
        mask: list[bool] = []
        for index, segment in enumerate(segments[1:]):  # call, tool result, call, ..., call
            response += segment
            mask += [index % 2 == 0] * len(segment)
        samples.append(Sample(f"{number}", f"r{number}", 0, segments[0], response,
                              [-3.0 if kept else 0.0 for kept in mask], 1.0, 1.0 if number % 2 else -1.0,
                              loss_mask=tuple(mask), merged_calls=len(segments[1::2])))
    return samples


def forwarded(micro: MicroBatch | PackedMicroBatch) -> tuple[int, int]:
    """Real tokens the model runs on in one micro-batch (a packed row's prompt once), and with padding."""
    if isinstance(micro, PackedMicroBatch):
        return int(micro.attends[:, :, 0].sum()), micro.input_ids.numel()  # every real position sees the prompt's first
    return int(micro.attention_mask.sum()), micro.input_ids.numel()


def measure(policy: Policy, settings: TrainerConfig, samples: list[Sample], rounds: int) -> dict[str, float]:
    """Tokens forwarded and trained per step, mean step seconds and the first step's loss."""
    micros = collate(samples, policy.pad_id, policy.device, settings.accumulation_steps)
    real, padded = (sum(pair) for pair in zip(*(forwarded(m) for m in micros), strict=True))
    first = train_step(policy, Batch(samples, 0, Counts()), settings)  # also the warm-up
    seconds = [train_step(policy, Batch(samples, 0, Counts()), settings).seconds for _ in range(rounds)]
    step = statistics.mean(seconds)
    return {"tokens_forwarded": real, "padded_tokens": padded, "trained_tokens": int(first.stats.tokens),
            "step_seconds": step, "trained_tokens_per_s": round(first.stats.tokens / step, 1),
            "loss": round(first.loss, 6),
            "samples": len(samples), "each": [round(s, 3) for s in seconds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="Model specs, comma-separated.")
    parser.add_argument("--groups", type=int, default=2, help="GRPO groups per step (each its own task prompt).")
    parser.add_argument("--group-size", type=int, default=4, help="Rollouts per group.")
    parser.add_argument("--calls", type=int, default=3, help="LLM calls per rollout.")
    parser.add_argument("--prompt", type=int, default=150, help="System + task prompt tokens.")
    parser.add_argument("--response", type=int, default=30, help="Generated tokens per call.")
    parser.add_argument("--tool", type=int, default=10, help="Tool-result tokens between calls.")
    parser.add_argument("--rounds", type=int, default=3, help="Steps measured per level, after one warm-up step.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads (1: as the demo's trainer runs).")
    args = parser.parse_args()
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    torch.set_num_threads(args.threads)
    shape = {"groups": args.groups, "group_size": args.group_size, "calls": args.calls, "prompt": args.prompt,
             "response": args.response, "tool": args.tool, "threads": args.threads}
    for model in args.models.split(","):
        settings = TrainerConfig(model=model, device="cpu", threads=args.threads, lr=1e-7, grad_clip=1e9)
        policy = build_policy(settings)
        vocabulary = min(int(policy.model.config.vocab_size), 5000)
        runs = rollouts(random.Random(0), vocabulary, args)
        figures = {level: measure(policy, settings, build(runs), args.rounds)
                   for level, build in (("transition", transition_level), ("trajectory", trajectory_level))}
        for level, numbers in figures.items():
            extra = {k: v for k, v in numbers.items() if k != "step_seconds"}
            emit(BENCH, "step_seconds", numbers["step_seconds"], "s", model=model, level=level, **shape, **extra)
        before, after = figures["transition"], figures["trajectory"]
        emit(BENCH, "tokens_forwarded_ratio", before["tokens_forwarded"] / after["tokens_forwarded"], "x", model=model,
             **shape)
        emit(BENCH, "step_speedup", before["step_seconds"] / after["step_seconds"], "x", model=model, **shape)


if __name__ == "__main__":
    main()
