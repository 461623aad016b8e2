"""The two-rank trainer's step time against one rank's, as ratios; and what sending a step's samples to the ranks costs.

One rank is ``train_step`` in this process, at ``--threads`` torch threads and at twice that
(the same cores as two ranks use); two ranks are two spawned gloo processes at ``--threads``
each, rank 0 timing ``Group.step`` (shard, scatter, forward and backward on its shard, the
gradient all-reduce, clip and step). Every figure is the median of ``--rounds`` steps on the
same GRPO-like batch, after one warm-up step. ``ratio`` is two ranks' step time over one rank's:
below 1 is a speed-up. On a machine with fewer cores than ranks × threads the ranks only
compete for them.

``scatter_records_ms`` / ``scatter_tensors_ms``: rank 0 sending each rank its shard as sample
records (what the trainer does) or as the collated tensors of each shard, both with
``scatter_object_list``; ``all_reduce_ms``: one all-reduce of a gradient the model's size.
Prints the machine's calibration first.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentstream.infra.config import TrainerConfig
from agentstream.infra.processes import free_port
from agentstream.stack.machine import calibrate
from agentstream.trainer.batching import Batch, Counts, Sample, collate
from agentstream.trainer.distributed import Group, Ranks, join, leave
from agentstream.trainer.policy import build_policy
from agentstream.trainer.step import train_step
from bench.common import emit

BENCH = "distributed_trainer"


def grpo_batch(vocab: int, groups: int, group_size: int, prompt_tokens: int, response_tokens: int) -> Batch:
    """``groups`` prompts with ``group_size`` answers each, of 25% to 100% of ``response_tokens``, advantages ±1."""
    rng = random.Random(0)
    samples = []
    for group in range(groups):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_tokens)]
        for index in range(group_size):
            length = rng.randint(max(1, response_tokens // 4), response_tokens)
            samples.append(Sample(f"g{group}-{index}", f"r{group}-{index}", 0, prompt,
                                  [rng.randrange(5, vocab) for _ in range(length)], [-3.0] * length, 1.0,
                                  1.0 if index % 2 else -1.0))
    return Batch(samples, 0, Counts())


def settings(args: argparse.Namespace, threads: int) -> TrainerConfig:
    return TrainerConfig(model=args.model, device="cpu", threads=threads, lr=1e-7, distributed_backend="gloo",
                         distributed_timeout_s=600)


def batch_for(args: argparse.Namespace, policy: Any) -> Batch:
    vocab = min(len(policy.tokenizer), 5000)
    return grpo_batch(vocab, args.groups, args.group_size, args.prompt_tokens, args.response_tokens)


def one_rank(args: argparse.Namespace, threads: int) -> list[float]:
    config = settings(args, threads)
    policy = build_policy(config)
    torch.set_num_threads(threads)
    batch = batch_for(args, policy)
    train_step(policy, batch, config)  # warm-up
    return [train_step(policy, batch, config).seconds for _ in range(args.rounds)]


def _rank(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config = settings(args, args.threads)
    ranks = Ranks(rank, 2, rank)
    join(config, ranks)
    try:
        policy = build_policy(config)
        torch.set_num_threads(args.threads)
        group = Group(policy, config, ranks)
        if rank != 0:
            group.follow()
            transfers(group, policy, None, args.rounds)
            return
        group.sync()
        batch = batch_for(args, policy)
        group.step(batch)  # warm-up
        seconds = [group.step(batch).seconds for _ in range(args.rounds)]
        group.stop()
        results.put({"step": seconds, **transfers(group, policy, batch, args.rounds)})
    finally:
        leave()


def transfers(group: Group, policy: Any, batch: Batch | None, rounds: int) -> dict[str, Any]:
    """Rank 0's time to scatter a step's shards as records and as collated tensors, and to all-reduce a gradient."""
    world = group.ranks.world
    shards = group.shard(batch.samples, "token", world) if batch is not None else []
    tensors = [collate([s for s, _ in shard], policy.pad_id, "cpu", weights=[w for _, w in shard])
               for shard in shards]
    figures: dict[str, Any] = {}
    for name, payload in (("records", shards), ("tensors", tensors)):
        times = []
        for _ in range(rounds + 1):
            received: list[Any] = [None]
            dist.barrier()
            started = time.perf_counter()
            dist.scatter_object_list(received, payload if batch is not None else None, src=0)
            times.append(time.perf_counter() - started)
        figures[name] = times[1:]
    gradient = torch.zeros(sum(p.numel() for p in policy.trainable()))
    times = []
    for _ in range(rounds + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(gradient)
        times.append(time.perf_counter() - started)
    figures["all_reduce"] = times[1:]
    figures["gradient_mb"] = gradient.numel() * 4 / 1e6
    return figures


def two_ranks(args: argparse.Namespace) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(rank, port, args, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    if any(process.exitcode != 0 for process in processes):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in processes]}")
    return results.get()


@dataclass(frozen=True)
class Comparison:
    """One rank's median step at ``threads`` and at twice that, and what two ranks measured (see ``two_ranks``)."""

    one: float
    one_doubled: float
    two: dict[str, Any]

    @property
    def two_step(self) -> float:
        return statistics.median(self.two["step"])


def measure(args: argparse.Namespace) -> Comparison:
    """One rank at ``args.threads`` and at twice that, then two ranks at ``args.threads`` each, on the same batch."""
    one = statistics.median(one_rank(args, args.threads))
    one_doubled = statistics.median(one_rank(args, 2 * args.threads))
    return Comparison(one, one_doubled, two_ranks(args))


def shape_of(args: argparse.Namespace) -> dict[str, Any]:
    """The measured step's model and batch, as every figure's JSON line names them."""
    return {"model": args.model, "transitions": args.groups * args.group_size, "prompt_tokens": args.prompt_tokens,
            "response_tokens_max": args.response_tokens, "backend": "gloo", "device": "cpu"}


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """This bench's options (``argv`` None: the command line's), so other benches measure with the same defaults."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="Model spec (tiny, smollm2 or a folder).")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per rank.")
    parser.add_argument("--rounds", type=int, default=5, help="Steps measured (after one warm-up step).")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=192)
    return parser.parse_args(argv)


def main() -> None:
    args = arguments()
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    shape = shape_of(args)
    measured = measure(args)
    one, one_doubled, two, two_step = measured.one, measured.one_doubled, measured.two, measured.two_step
    emit(BENCH, "step_seconds_one_rank", one, "s", threads=args.threads, **shape)
    emit(BENCH, "step_seconds_one_rank", one_doubled, "s", threads=2 * args.threads, **shape)
    emit(BENCH, "step_seconds_two_ranks", two_step, "s", threads_per_rank=args.threads, **shape,
         each=[round(s, 3) for s in two["step"]])
    emit(BENCH, "two_ranks_over_one_rank", two_step / one, "ratio", one_rank_threads=args.threads,
         threads_per_rank=args.threads, **shape)
    emit(BENCH, "two_ranks_over_one_rank", two_step / one_doubled, "ratio", one_rank_threads=2 * args.threads,
         threads_per_rank=args.threads, **shape)
    emit(BENCH, "scatter_records_ms", 1000 * statistics.median(two["records"]), "ms", **shape)
    emit(BENCH, "scatter_tensors_ms", 1000 * statistics.median(two["tensors"]), "ms", **shape)
    emit(BENCH, "all_reduce_ms", 1000 * statistics.median(two["all_reduce"]), "ms",
         gradient_mb=round(two["gradient_mb"], 1), **shape)


if __name__ == "__main__":
    main()
