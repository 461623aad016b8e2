"""Learning speed: time until held-out greedy accuracy reaches the target, streamed pipeline vs a plain loop.

Ours is the demo itself (``agentstream.demo.run_demo``): runners, proxy, dev server, Kafka,
streams, trainer and hot swap as separate processes, generation overlapping training. The
peer is the plain synchronous loop on the same machine, model, task split, precision and
hyperparameters: generate 4 prompts x 8 samples (from a copy that generates as the dev server
does: the same attention kernel, Linear weights cast once under mixed precision),
group-normalise rewards, skip groups without spread, one optimizer step with the same loss
code, repeat. Each side trains for ``--seconds`` and keeps a snapshot of its weights every
``--eval-every`` seconds (ours: what the model server held, hard-linked from the trainer's
checkpoints; the peer: a copy in memory). Afterwards one evaluator scores every snapshot of
both sides the same way (greedy, on ``--heldout`` held-out tasks, 160 by default: about +-5.5
points at 85% instead of +-11 on the demo's 64), so evaluation takes no time from either run
and the two curves differ only in how they trained.
Prints JSON lines; ``ratio`` = ours / peer (lower is better).

So that a run explains itself, both sides report in the same run: time to 65%, 75% and the
target (a ratio even when one side misses the last), policy versions per minute (speed) and
accuracy by version (sample efficiency, apart from speed), the held-out accuracy at the end with
its 95% Wilson interval, and each process's share of the machine's CPU (1.0 = every core busy),
after a machine calibration line.
"""

from __future__ import annotations

import argparse
import copy
import random
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from agentstream.demo import run_demo
from agentstream.demo.training import compute_dtype
from agentstream.examples import arithmetic
from agentstream.infra.config import Config, ConfigError, load_config
from agentstream.models import LoadedModel, assign_weights, eos_token_ids, load_model
from agentstream.models.precision import cast_linears_for_inference, resolve_precision
from agentstream.serving.attention import use_grouped_attention
from agentstream.serving.generation import BatchRequest, SamplingParams, generate_batch
from agentstream.serving.tool_format import render_prompt, renders_tools
from agentstream.stack.machine import CpuShare, calibrate
from agentstream.streams.credit import GroupNormalized
from agentstream.trainer.batching import Batch, Counts, Sample
from agentstream.trainer.policy import build_policy
from agentstream.trainer.step import train_step
from bench.common import emit
from tests.support.intervals import wilson_interval

TARGETS = (0.65, 0.75)  # besides demo.target
SNAPSHOTS = Path("bench-output/snapshots")


@dataclass
class Snapshot:
    """One side's weights ``seconds`` into its training, at ``version`` (no weights: the base model)."""

    seconds: float
    version: int
    weights: dict[str, torch.Tensor] | Path | None


@dataclass
class Run:
    """One side's learning curve: held-out evaluations (seconds since training began, version, accuracy)."""

    evaluations: list[tuple[float, int, float]]
    heldout_tasks: int
    training_seconds: float
    policy_versions: int
    cpu_share: dict[str, float]

    def time_to(self, target: float) -> float | None:
        return next((seconds for seconds, _, accuracy in self.evaluations if seconds >= 0 and accuracy >= target), None)

    @property
    def versions_per_min(self) -> float:
        return self.policy_versions / max(self.training_seconds, 1e-9) * 60

    @property
    def accuracy_by_version(self) -> list[list[float]]:
        """[version, accuracy] per distinct version (a side may hold one version over several snapshots)."""
        first = {version: accuracy for _, version, accuracy in reversed(self.evaluations)}
        return [[version, round(accuracy, 4)] for version, accuracy in sorted(first.items())]

    @property
    def after(self) -> float:
        return self.evaluations[-1][2]


def task_prompt(tokenizer, native_tools: bool, task: dict) -> list[int]:
    """The token ids the agent's one chat call sends for ``task``, as both sides and the judge render it."""
    return render_prompt(tokenizer, [{"role": "user", "content": task["prompt"]}], None, native_tools)


class Judge:
    """Greedy held-out accuracy of any snapshot, computed the same way for both sides after both ran."""

    def __init__(self, config: Config, heldout: list[dict]) -> None:
        self.precision = resolve_precision("cpu", compute_dtype(config))
        self.loaded = load_model("smollm2", precision=self.precision, threads=2, inference_only=True)
        self.base = {name: tensor.clone() for name, tensor in self.loaded.model.state_dict().items()}
        self.heldout = heldout
        self.native_tools = renders_tools(self.loaded.tokenizer)

    def accuracy(self, snapshot: Snapshot) -> float:
        weights = snapshot.weights
        assign_weights(self.loaded.model, self.base if weights is None else
                       load_file(weights) if isinstance(weights, Path) else weights)
        tokenizer = self.loaded.tokenizer
        requests = [BatchRequest(task_prompt(tokenizer, self.native_tools, task),
                                 SamplingParams(max_tokens=arithmetic.MAX_TOKENS, temperature=0.0))
                    for task in self.heldout]
        results = generate_batch(self.loaded.model, tokenizer, requests, eos_token_ids(self.loaded),
                                 tokenizer.pad_token_id or 0, autocast=self.precision.autocast)
        correct = sum(arithmetic.reward(r[0].text, t["answer"]) for r, t in zip(results, self.heldout, strict=True))
        return correct / len(self.heldout)

    def curve(self, name: str, snapshots: list[Snapshot]) -> list[tuple[float, int, float]]:
        """[(seconds, version, accuracy)] from the base model on; each version is evaluated once."""
        by_version: dict[int, float] = {}
        curve = []
        for snapshot in [Snapshot(0.0, 0, None), *snapshots]:
            if snapshot.version not in by_version:
                started = time.monotonic()
                by_version[snapshot.version] = self.accuracy(snapshot)
                print(f"{name}: {snapshot.seconds:.0f} s, v{snapshot.version}: held-out "
                      f"{by_version[snapshot.version]:.1%} (evaluated in {time.monotonic() - started:.0f} s)",
                      flush=True)
            curve.append((snapshot.seconds, snapshot.version, by_version[snapshot.version]))
        return curve


def peer_run(config: Config) -> tuple[list[Snapshot], float]:
    """The plain loop; returns its snapshots every ``demo.eval_every_s`` and its training seconds."""
    demo = config.demo
    trainer = replace(config.trainer, model="smollm2", threads=2, lr=demo.lr, dtype=compute_dtype(config),
                      temperature=1.0)
    policy = build_policy(trainer)
    tokenizer, model = policy.tokenizer, policy.model
    eos = eos_token_ids(LoadedModel(model, tokenizer, policy.name, policy.dtype))
    sampler = copy.deepcopy(model)  # generates as the dev server does: its attention, Linear weights cast once
    sampler.set_attn_implementation("sdpa")
    use_grouped_attention(sampler)
    if policy.precision.mixed:
        cast_linears_for_inference(sampler, policy.precision)
    pad = tokenizer.pad_token_id or 0
    native_tools = renders_tools(tokenizer)

    def prompt(task: dict) -> list[int]:
        return task_prompt(tokenizer, native_tools, task)

    def generate(tasks: list[dict], params: SamplingParams):
        sampler.eval()
        return generate_batch(sampler, tokenizer, [BatchRequest(prompt(t), params) for t in tasks], eos, pad,
                              autocast=policy.precision.autocast)

    train, _ = arithmetic.split(heldout=demo.heldout_tasks)
    rng = random.Random(0)
    grpo = GroupNormalized()
    snapshots: list[Snapshot] = []
    started = time.monotonic()
    next_snapshot, version = started + demo.eval_every_s, 0
    order: list[dict] = []
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
            assign_weights(sampler, model.state_dict())
            version += 1
        if time.monotonic() >= next_snapshot:
            snapshots.append(Snapshot(round(time.monotonic() - started, 1), version, _copy(model)))
            print(f"peer: {snapshots[-1].seconds:.0f} s, v{version}", flush=True)
            next_snapshot += demo.eval_every_s
    training_seconds = time.monotonic() - started
    snapshots.append(Snapshot(round(training_seconds, 1), version, _copy(model)))
    return snapshots, training_seconds


def _copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights, one copy per storage (a tied head and its embeddings stay one tensor)."""
    copies: dict[int, torch.Tensor] = {}
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in copies:
            copies[tensor.data_ptr()] = tensor.detach().clone()
    return {name: copies[tensor.data_ptr()] for name, tensor in model.state_dict().items()}


def report_side(name: str, run: Run, other: Run | None, target: float) -> None:
    """The JSON lines of one side (``ours`` or ``peer``), with the other side's figures beside ours."""
    prefix = "" if name == "ours" else "peer_"
    for goal in (*TARGETS, target):
        seconds = run.time_to(goal)
        extra: dict = {"reached": seconds is not None}
        if name == "ours" and other is not None:
            theirs = other.time_to(goal)
            extra.update(peer=theirs, ratio=round(seconds / theirs, 3) if seconds is not None and theirs else None)
        emit("learning", f"{prefix}time_to_{round(goal * 100)}pct_s", seconds, "s", **extra)
    emit("learning", f"{prefix}versions_per_min", run.versions_per_min, "versions/min",
         policy_versions=run.policy_versions, training_seconds=round(run.training_seconds, 1))
    emit("learning", f"{prefix}accuracy_by_version", run.after, "accuracy", by_version=run.accuracy_by_version)
    emit("learning", f"{prefix}heldout_after", run.after, "accuracy", before=run.evaluations[0][2],
         interval95=wilson_interval(run.after, run.heldout_tasks), heldout_tasks=run.heldout_tasks)
    emit("learning", f"{prefix}cpu_share", sum(run.cpu_share.values()), "share of all cores",
         by_process=run.cpu_share)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="Each side's training time.")
    parser.add_argument("--eval-every", type=float, default=30.0, help="Seconds between snapshots of the weights.")
    parser.add_argument("--heldout", type=int, default=160,
                        help="Held-out tasks (of 400) both sides are scored on; the rest train.")
    parser.add_argument("--only", choices=["ours", "peer"], default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: the demo's stack goes down with it
    config = load_config()
    try:
        config = replace(config, demo=replace(config.demo, quick=False,
                                              output_dir="bench-output", eval_every_s=args.eval_every,
                                              seconds=args.seconds, heldout_tasks=args.heldout,
                                              report_path="bench-output/learning-report.json"))
    except ConfigError as error:
        parser.error(str(error))
    calibration = calibrate()
    emit("learning", "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    snapshots: dict[str, list[Snapshot]] = {}
    shares: dict[str, dict[str, float]] = {}
    speed: dict[str, tuple[float, int]] = {}
    if args.only in (None, "ours"):
        folder = SNAPSHOTS / uuid.uuid4().hex[:8]
        with CpuShare("bench (demo driver)", calibration.cores) as cpu:
            report = run_demo(config, snapshots=folder)
        snapshots["ours"] = [Snapshot(s.seconds, s.policy_version, Path(s.weights) if s.weights else None)
                             for s in report.snapshots]
        shares["ours"], speed["ours"] = cpu.shares(), (report.training_seconds, report.policy_versions)
    if args.only in (None, "peer"):
        torch.set_num_threads(2)
        with CpuShare("bench (plain loop)", calibration.cores) as cpu:
            snapshots["peer"], training_seconds = peer_run(config)
        shares["peer"], speed["peer"] = cpu.shares(), (training_seconds, snapshots["peer"][-1].version)
    print(f"evaluating {sum(map(len, snapshots.values()))} snapshots on {args.heldout} held-out tasks", flush=True)
    judge = Judge(config, arithmetic.split(heldout=args.heldout)[1])
    runs = {name: Run(judge.curve(name, taken), args.heldout, *speed[name], shares[name])
            for name, taken in snapshots.items()}
    if args.only in (None, "ours"):
        shutil.rmtree(folder, ignore_errors=True)
    ours, peer = runs.get("ours"), runs.get("peer")
    if peer is not None:
        report_side("peer", peer, None, config.demo.target)
    if ours is not None:
        report_side("ours", ours, peer, config.demo.target)


if __name__ == "__main__":
    main()
