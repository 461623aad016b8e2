"""The trainer as data-parallel ranks on torch.distributed: rank 0 reads Kafka and leads, the other ranks follow.

Rank 0 is the trainer of ``trainer/worker.py``: the only member of the consumer group, the only
writer of checkpoints. For each step it computes the token weights over the whole batch
(``token_weights``), cuts the weighted samples into one shard per rank and scatters them; every
rank runs forward and backward on its shard with those weights, the gradients are summed over
the ranks (one all-reduce), and every rank clips and steps its own copy of the optimizer on the
same summed gradient. The weights sum to 1 over the step, not over a shard, so the sum of the
shards' gradients is the gradient one rank takes on the whole batch: N ranks hold the weights
one rank would, up to the order of float additions. (Averaging per-rank means, as DDP does with
a per-rank mean loss, is wrong as soon as shards hold different numbers of tokens.)

Ranks other than 0 never touch Kafka, ClickHouse or the checkpoint store: they receive commands
from rank 0 (``step``, ``sync`` the weights and optimizer state after rank 0 loaded a
checkpoint, ``noop`` to keep an idle group within the collective timeout, ``stop``). A rank that
dies makes the next collective fail on every other rank, which then exits non-zero; rank 0 has
committed no offset past its last checkpoint, so the restarted group trains again exactly the
transitions after it.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agentstream.infra.config import TrainerConfig
from agentstream.trainer.batching import Batch, Sample, collate, token_weights
from agentstream.trainer.loss import TokenStats
from agentstream.trainer.policy import Policy
from agentstream.trainer.step import StepResult, accumulate, apply_gradients

Shard = list[tuple[Sample, float]]
"""One rank's samples of a step, each with the loss weight of its trained tokens (over the whole step)."""

STOP, STEP, SYNC, NOOP = "stop", "step", "sync", "noop"
STATS = len(TokenStats.__dataclass_fields__)
JOIN_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the group, as torchrun sets it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Ranks | None:
        """The ranks torchrun started, or None for a plain single process (``WORLD_SIZE`` unset)."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return None
        return cls(int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))

    @property
    def leader(self) -> bool:
        return self.rank == 0


def backend_for(config: TrainerConfig) -> str:
    """``trainer.distributed_backend``, with ``auto`` resolved: NCCL where the trainer runs on CUDA, gloo elsewhere."""
    if config.distributed_backend != "auto":
        return config.distributed_backend
    on_cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    return "nccl" if on_cuda else "gloo"


def rank_config(config: TrainerConfig, ranks: Ranks) -> TrainerConfig:
    """The trainer settings of one rank: on CUDA, the GPU of its local rank."""
    if backend_for(config) == "nccl" and config.device in ("auto", "cuda"):
        return replace(config, device=f"cuda:{ranks.local_rank}")
    return config


def join(config: TrainerConfig, ranks: Ranks) -> str:
    """Join the process group (``env://``: torchrun's MASTER_ADDR and MASTER_PORT); returns the backend.

    The keys of each torchrun attempt (``TORCHELASTIC_RESTART_COUNT``) get a prefix of their own:
    torchrun keeps one store across restarts, and a rank that started before rank 0 of the new
    attempt read rank 0's address from the attempt before, a dead process (measured: gloo's
    ``connectFullMesh`` failed with "Connection refused", and the restart with it).
    Joining waits up to ``JOIN_TIMEOUT`` (or the collective timeout, if longer) for the other
    ranks: rank 0 waits for ClickHouse and loads the model before it joins.

    ``torch._dynamo`` is imported before the group exists: the first optimizer imports it, and
    imported while a group exists it keeps that group alive after ``destroy_process_group``, so
    gloo's worker threads outlive it and one that releases its last collective while the
    interpreter exits aborts the process ("terminate called without an active exception";
    measured: about 1 two-rank run in 10 under load, either rank, after a clean stop).
    """
    backend = backend_for(config)
    if backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
    importlib.import_module("torch._dynamo")  # before the group exists: see the docstring
    timeout = timedelta(seconds=config.distributed_timeout_s)
    waiting = max(timeout, JOIN_TIMEOUT)
    store, _, _ = next(dist.rendezvous("env://", ranks.rank, ranks.world, timeout=waiting))
    store.set_timeout(waiting)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"agentstream-attempt-{attempt}", store),
                            rank=ranks.rank, world_size=ranks.world, timeout=timeout)
    return backend


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_batch(samples: list[Sample], normalization: str, world: int) -> list[Shard]:
    """The step's samples with their weights (computed over all of them), cut into ``world`` shards of similar tokens.

    Samples are ordered as ``collate`` orders them (a group's samples, which share a prompt, side
    by side, so a rank can pack them) and cut where the running token count passes each rank's
    share. A batch of fewer samples than ranks leaves some shards empty.
    """
    weighted = list(zip(samples, token_weights(samples, normalization), strict=True))
    shared = len({tuple(s.prompt_ids) for s in samples}) < len(samples)
    weighted.sort(key=(lambda p: (len(p[0].prompt_ids), p[0].prompt_ids, len(p[0].response_ids)))
                  if shared else (lambda p: p[0].length))
    total = sum(s.length for s, _ in weighted)
    shards: list[Shard] = [[] for _ in range(world)]
    done = 0
    for pair in weighted:
        middle = done + pair[0].length / 2
        shards[min(world - 1, int(middle * world / total))].append(pair)
        done += pair[0].length
    return shards


class Group:
    """One rank's end of the data-parallel trainer: ``step`` and ``sync`` on rank 0, ``follow`` on the others.

    Every collective runs on the thread that calls these methods (the worker's model thread on
    rank 0), so the ranks issue them in the same order.
    """

    def __init__(self, policy: Policy, config: TrainerConfig, ranks: Ranks,
                 shard: Callable[[list[Sample], str, int], list[Shard]] = shard_batch) -> None:
        self.policy = policy
        self.config = config
        self.ranks = ranks
        self.shard = shard
        self.device = policy.device
        self.keepalive_s = config.distributed_timeout_s / 4
        self.last_command = time.monotonic()

    # ------------------------------------------------------------------ rank 0

    def step(self, batch: Batch) -> StepResult:
        """Train one batch over all ranks; the result holds the whole step's loss and token statistics."""
        started = time.perf_counter()
        shards = self.shard(batch.samples, self.config.loss_normalization, self.ranks.world)
        self._send([(STEP, shard) for shard in shards])
        stats, loss, grad_norm, skipped = self._train(shards[self.ranks.rank])
        return StepResult(stats, loss, grad_norm, len(batch.samples), batch.tokens, time.perf_counter() - started,
                          skipped)

    def sync(self) -> None:
        """Give every rank rank 0's trainable weights and optimizer state (after a load, and once at the start)."""
        state = self.policy.optimizer.state_dict()
        layout = {"param_groups": state["param_groups"],  # a tensor's device: the CPU, or each rank's own
                  "state": {index: {key: (tuple(value.shape), value.dtype, value.device.type == "cpu")
                                    if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
                            for index, entry in state["state"].items()}}
        self._send([(SYNC, layout)] * self.ranks.world)
        self._broadcast_state(state)

    def keepalive(self) -> None:
        """A command that does nothing, so that ranks waiting for the next step stay within the collective timeout."""
        self._send([(NOOP, None)] * self.ranks.world)

    def idle_s(self) -> float:
        return time.monotonic() - self.last_command

    def stop(self) -> None:
        self._send([(STOP, None)] * self.ranks.world)

    def _send(self, messages: list[tuple[str, Any]]) -> None:
        received: list[Any] = [None]
        dist.scatter_object_list(received, messages, src=0)
        self.last_command = time.monotonic()

    # ------------------------------------------------------------------ other ranks

    def follow(self) -> int:
        """Run rank 0's commands until it says stop; returns the number of steps taken."""
        steps = 0
        while True:
            received: list[Any] = [None]
            dist.scatter_object_list(received, None, src=0)
            command, payload = received[0]
            if command == STEP:
                self._train(payload)
                steps += 1
            elif command == SYNC:
                self._receive_state(payload)
            elif command == STOP:
                return steps

    def _receive_state(self, layout: dict[str, Any]) -> None:
        state = {index: {key: torch.empty(value[0], dtype=value[1], device="cpu" if value[2] else self.device)
                         if isinstance(value, tuple) else value for key, value in entry.items()}
                 for index, entry in layout["state"].items()}
        self._broadcast_state({"state": state, "param_groups": layout["param_groups"]})
        self.policy.optimizer.load_state_dict({"state": state, "param_groups": layout["param_groups"]})

    # ------------------------------------------------------------------ every rank

    def _broadcast_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for parameter in self.policy.trainable():
                self._broadcast(parameter.data)
            for index in sorted(state["state"]):
                for key in sorted(state["state"][index]):
                    value = state["state"][index][key]
                    if isinstance(value, torch.Tensor):
                        self._broadcast(value)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if tensor.device == self.device:
            dist.broadcast(tensor, src=0)
            return
        moved = tensor.to(self.device)  # AdamW may keep its step count on the CPU; NCCL sends device tensors only
        dist.broadcast(moved, src=0)
        tensor.copy_(moved)

    def _train(self, shard: Shard) -> tuple[TokenStats, float, float, bool]:
        """Forward and backward on this rank's shard, sum the gradients over the ranks, clip and step."""
        self.policy.model.train()
        stats, loss = TokenStats(), 0.0
        if shard:
            micros = collate([s for s, _ in shard], self.policy.pad_id, self.device, self.config.accumulation_steps,
                             micro_batch_tokens=self.config.micro_batch_tokens, weights=[w for _, w in shard])
            stats, loss = accumulate(self.policy, micros, self.config)
        stats, loss = self._sum_gradients(stats, loss)
        grad_norm, skipped = apply_gradients(self.policy, self.config, loss)
        return stats, loss, grad_norm, skipped

    def _sum_gradients(self, stats: TokenStats, loss: float) -> tuple[TokenStats, float]:
        """Sum the ranks' gradients, losses and token statistics; a parameter no rank reached keeps no gradient.

        Which parameters have a gradient is summed first, so that a rank whose shard missed one (or
        was empty) adds zeros where another rank has one, and a parameter no shard reached is left
        without a gradient, as one rank on the whole batch leaves it (AdamW skips it).
        """
        parameters = self.policy.trainable()
        totals = torch.tensor([loss, *(getattr(stats, name) for name in TokenStats.__dataclass_fields__),
                               *(p.grad is not None for p in parameters)], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        reached = [p for p, count in zip(parameters, totals[1 + STATS:].tolist(), strict=True) if count > 0]
        for parameter in reached:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for parameter in reached:
            assert parameter.grad is not None  # set just above
            by_dtype.setdefault(parameter.grad.dtype, []).append(parameter.grad)
        for grads in by_dtype.values():  # one all-reduce per dtype, not one per tensor
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        values = totals[:1 + STATS].tolist()
        return TokenStats(*values[1:]), values[0]
