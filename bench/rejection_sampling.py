"""Rejection sampling: what supervised steps on the demo agent's own good rollouts add before RL starts.

The demo's arithmetic agent (``examples/arithmetic.py``) on SmolLM2-135M-Instruct, through the
real pipeline on a private stack: runners, proxy, dev model server, streams (the demo's GRPO
credit rule, flat groups kept) and hot swap, as separate processes. Held-out greedy accuracy of
the base model first; then ``--prompts`` train tasks × ``--samples`` rollouts at the demo's
temperature, and rollouts with reward ≥ ``--min-reward`` are trained by likelihood, ``--batch``
transitions per step, from one of two sources:

* ``--source stream`` (the default, ``make bench-sft``): the trainer runs with ``objective =
  "supervised"`` while sampling goes on (the server swaps in each checkpoint, so later rollouts
  come from the newer weights); done once every kept transition is trained and the server holds
  the last checkpoint.
* ``--source dataset``: no trainer runs while the base model samples; then the commands a user
  types: ``agentstream dataset export good.parquet --min-reward R --agent arithmetic`` and
  ``agentstream sft --dataset good.parquet --epochs N``; done once hot swap has loaded its checkpoint.

Then held-out greedy accuracy again. Prints JSON lines: the machine calibration, then
before/after with their 95% Wilson intervals, the counts and the seconds of each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path

from agentstream.demo.agents import AGENTS
from agentstream.demo.training import DATABASE, demo_config, evaluate, server_version
from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.runner.tasks import enqueue, grouped_tasks
from agentstream.pipeline.sdk import set_sink
from agentstream.session import SessionPlan, TrainingSession
from agentstream.stack.machine import calibrate
from bench.common import emit, private_stack
from tests.support.intervals import wilson_interval

AGENT = AGENTS["arithmetic"]
BENCH = "rejection_sampling"


def bench_config(config: Config, workdir: Path, args: argparse.Namespace) -> Config:
    """The demo's settings, its trainer in supervised mode: ``args.batch`` kept transitions per step."""
    config = demo_config(config, uuid.uuid4().hex[:8], workdir, AGENT)
    demo = replace(config.demo, group_size=args.samples, heldout_tasks=args.heldout)
    credit = tuple(replace(rule, group_size=args.samples) if rule.agent == AGENT.name else rule
                   for rule in config.credit)
    return replace(config, demo=demo, credit=credit, trainer=replace(
        config.trainer, objective="supervised", supervised_min_reward=args.min_reward, lr=args.lr,
        batch_transitions=args.batch, batch_counts_skipped=False, batch_wait_s=5.0))


def scalar(client, sql: str) -> float:
    return client.query(sql).result_rows[0][0] or 0


async def measure(config: Config, endpoints, session: TrainingSession, client, args: argparse.Namespace) -> None:
    """Before, sampling and supervised steps through the pipeline from ``args.source``, after; the JSON lines."""
    train, heldout = AGENT.module.split(heldout=args.heldout)
    served = partial(server_version, session.server_url)
    publisher = SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=session.workdir / "journal").start()
    set_sink(publisher)
    try:
        session.start_runners(progress=print)
        phase = time.monotonic()
        before = await evaluate(AGENT, heldout, session.proxy_url, session.proxy_key, served, 0.0)
        seconds = {"heldout_before_s": time.monotonic() - phase}
        print(f"held-out before: {before.accuracy:.1%} ({before.correct}/{before.total})", flush=True)
        payloads = [{**task, "temperature": AGENT.temperature} for task in train[:args.prompts]]
        total = await enqueue(config, endpoints.bootstrap_servers, grouped_tasks(
            payloads, group_size=args.samples, agent_name=AGENT.name, timeout_s=600))
        if args.source == "stream":
            seconds["sampling_and_training_s"] = await sample(session, client, args, total, training=True)
        else:
            seconds["sampling_s"] = await sample(session, client, args, total, training=False)
            seconds |= await supervised_from_dataset(session, client, args)
        phase = time.monotonic()
        after = await evaluate(AGENT, heldout, session.proxy_url, session.proxy_key, served, 0.0)
        seconds["heldout_after_s"] = time.monotonic() - phase
        print(f"held-out after: {after.accuracy:.1%} ({after.correct}/{after.total}, v{after.policy_version})",
              flush=True)
    finally:
        set_sink(None)
        await asyncio.to_thread(publisher.close)
    name = AGENT.name
    steps, step_seconds, trained = client.query(
        "SELECT count(), sum(step_time_s), sum(transitions) FROM train_steps FINAL").result_rows[0]
    done = scalar(client, f"SELECT count() FROM rollouts FINAL WHERE agent_name = '{name}'")
    kept = scalar(client, f"SELECT countIf(return_value >= {args.min_reward}) FROM transitions FINAL "
                          f"WHERE agent_name = '{name}'")
    sampled_success = scalar(client, f"SELECT avg(final_reward >= {args.min_reward}) FROM rollouts FINAL "
                                     f"WHERE agent_name = '{name}'")
    kept_rollouts = scalar(client, f"SELECT count() FROM rollouts FINAL WHERE agent_name = '{name}' "
                                   f"AND final_reward >= {args.min_reward}")
    emit(BENCH, "heldout_before", before.accuracy, "accuracy", correct=before.correct, tasks=before.total,
         interval95=wilson_interval(before.accuracy, before.total), judged=AGENT.judged)
    emit(BENCH, "sampled", done, "rollouts", prompts=args.prompts, per_prompt=args.samples,
         temperature=AGENT.temperature, success=round(sampled_success, 4), kept_rollouts=kept_rollouts,
         kept_transitions=kept, min_reward=args.min_reward)
    emit(BENCH, "supervised_steps", steps, "steps", source=args.source, trained_transitions=trained,
         step_seconds=round(step_seconds, 1), lr=args.lr, batch=args.batch, policy_version=after.policy_version,
         **({"epochs": args.epochs} if args.source == "dataset" else {}),
         **{key: round(value, 1) for key, value in seconds.items()})
    emit(BENCH, "heldout_after", after.accuracy, "accuracy", before=before.accuracy, correct=after.correct,
         tasks=after.total, interval95=wilson_interval(after.accuracy, after.total))


async def sample(session: TrainingSession, client, args: argparse.Namespace, total: int, *, training: bool) -> float:
    """Wait until every task's rollouts are done and credited (``training``: and every kept transition trained and
    the server holding the last checkpoint); returns the seconds it took."""
    started, name = time.monotonic(), AGENT.name
    while True:
        session.check()
        done, calls = client.query(f"SELECT count(), sum(llm_calls) FROM rollouts FINAL "
                                   f"WHERE agent_name = '{name}'").result_rows[0]
        credited, kept = client.query(f"SELECT count(), countIf(return_value >= {args.min_reward}) FROM "
                                      f"transitions FINAL WHERE agent_name = '{name}'").result_rows[0]
        progress = f"{time.monotonic() - started:.0f} s: {done}/{total} rollouts, {credited} credited, {kept} kept"
        finished = done >= total and credited >= calls
        if training:
            trained = scalar(client, "SELECT sum(transitions) FROM train_steps FINAL")
            latest = scalar(client, "SELECT max(version) FROM checkpoints FINAL")
            held = await asyncio.to_thread(server_version, session.server_url)
            progress += f", {trained} trained, checkpoint v{latest}, server v{held}"
            finished = finished and trained >= kept and held >= latest
        print(progress, flush=True)
        if finished:
            return time.monotonic() - started
        if time.monotonic() - started > args.timeout:
            raise TimeoutError(f"not done after {args.timeout:.0f} s (see the logs in {session.workdir})")
        await asyncio.sleep(2.0)


async def supervised_from_dataset(session: TrainingSession, client, args: argparse.Namespace) -> dict[str, float]:
    """Export the good rollouts and train on them with the CLI, as a user would; wait for hot swap to load it."""
    dataset = session.workdir / "good.parquet"
    seconds: dict[str, float] = {}
    commands = {"export_s": ("export", ["dataset", "export", str(dataset), "--min-reward", f"{args.min_reward:g}",
                                        "--agent", AGENT.name], 1),
                "sft_s": ("sft", ["sft", "--dataset", str(dataset), "--epochs", str(args.epochs)],
                          session.config.trainer.threads)}
    for phase, (name, command, threads) in commands.items():
        started = time.monotonic()
        print(f"$ agentstream {' '.join(command)}", flush=True)
        output = await asyncio.to_thread(session.run_command, name, command, threads, args.timeout)
        seconds[phase] = time.monotonic() - started
        print(output.rstrip(), flush=True)
    started = time.monotonic()
    latest = scalar(client, "SELECT max(version) FROM checkpoints FINAL")
    while (held := await asyncio.to_thread(server_version, session.server_url)) < latest:
        session.check()
        if time.monotonic() - started > args.timeout:
            raise TimeoutError(f"the server holds v{held}, not v{latest}, after {args.timeout:.0f} s")
        await asyncio.sleep(0.5)
    seconds["hot_swap_s"] = time.monotonic() - started
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", choices=("stream", "dataset"), default="stream",
                        help="stream: the supervised trainer steps while rollouts arrive; dataset: sample with no "
                        "trainer, then `agentstream dataset export` and `agentstream sft`.")
    parser.add_argument("--prompts", type=int, default=32, help="Train tasks sampled.")
    parser.add_argument("--samples", type=int, default=8, help="Rollouts per train task (one GRPO group).")
    parser.add_argument("--min-reward", type=float, default=1.0, help="Keep rollouts with at least this reward.")
    parser.add_argument("--batch", type=int, default=16, help="Kept transitions per supervised step.")
    parser.add_argument("--epochs", type=int, default=3, help="--source dataset: passes of `agentstream sft`.")
    parser.add_argument("--lr", type=float, default=3e-5, help="The supervised steps' learning rate.")
    parser.add_argument("--heldout", type=int, default=64, help="Held-out tasks (the demo's 64 by default).")
    parser.add_argument("--timeout", type=float, default=480.0, help="Seconds allowed to each phase.")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: the stack goes down with it
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    with private_stack(CLICKHOUSE_DATABASE=DATABASE) as (config, endpoints):  # a fresh stack: an empty database
        workdir = config.stack.home.resolve() / "rejection-sampling"
        config = bench_config(config, workdir, args)
        client = connect(config.clickhouse, endpoints.clickhouse_url, database=DATABASE)
        session = TrainingSession(config, endpoints, workdir, SessionPlan(
            agent=AGENT.entry, model="smollm2", concurrency=min(64, args.prompts * args.samples),
            server_threads=config.demo.server_threads, trainer=args.source == "stream"))
        try:
            session.start(progress=print)
            asyncio.run(measure(config, endpoints, session, client, args))
        finally:
            session.stop()
            client.close()


if __name__ == "__main__":
    main()
