"""Rejection sampling: what supervised steps on the demo agent's own good rollouts add before RL starts.

The demo's arithmetic agent (``examples/arithmetic.py``) on SmolLM2-135M-Instruct, through the
real pipeline on a private stack: runners, proxy, dev model server, streams (the demo's GRPO
credit rule, flat groups kept), the trainer with ``objective = "supervised"`` and hot swap, as
separate processes. Held-out greedy accuracy of the base model first; then ``--prompts`` train
tasks × ``--samples`` rollouts at the demo's temperature; the trainer keeps the transitions of
rollouts with reward ≥ ``--min-reward`` and trains them by likelihood, ``--batch`` per step, while
sampling goes on (the server swaps in each checkpoint, so later rollouts come from the newer
weights); once every kept transition is trained and the server holds the last checkpoint, held-out
greedy accuracy again. Prints JSON lines: the machine calibration, then before/after with their
95% Wilson intervals and the counts (rollouts sampled, kept, steps, seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
import uuid
from dataclasses import replace
from pathlib import Path

from agentstream.demo.training import AGENTS, DATABASE, demo_config, evaluate, server_version
from agentstream.session import SessionPlan, TrainingSession
from bench.common import emit, private_stack
from bench.learning import wilson_interval
from infra.clickhouse import connect
from infra.config import Config
from pipeline.publisher import SpanPublisher
from pipeline.sdk import set_sink
from pipeline.tasks import enqueue, grouped_tasks
from stack.machine import calibrate

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
    """Before, sampling and supervised steps through the pipeline, after; the JSON lines."""
    train, heldout = AGENT.module.split(heldout=args.heldout)
    publisher = SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=session.workdir / "journal").start()
    set_sink(publisher)
    try:
        session.start_runners(progress=print)
        before = await evaluate(AGENT, heldout, session.proxy_url, session.proxy_key, session.server_url, 0.0)
        print(f"held-out before: {before.accuracy:.1%} ({before.correct}/{before.total})", flush=True)
        started = time.monotonic()
        payloads = [{**task, "temperature": AGENT.temperature} for task in train[:args.prompts]]
        total = await enqueue(config, endpoints.bootstrap_servers, grouped_tasks(
            payloads, group_size=args.samples, agent_name=AGENT.name, timeout_s=600))
        name = AGENT.name
        while True:
            session.check()
            done, calls = client.query(f"SELECT count(), sum(llm_calls) FROM rollouts FINAL "
                                       f"WHERE agent_name = '{name}'").result_rows[0]
            credited, kept = client.query(f"SELECT count(), countIf(return_value >= {args.min_reward}) FROM "
                                          f"transitions FINAL WHERE agent_name = '{name}'").result_rows[0]
            trained = scalar(client, "SELECT sum(transitions) FROM train_steps FINAL")
            latest = scalar(client, "SELECT max(version) FROM checkpoints FINAL")
            held = await asyncio.to_thread(server_version, session.server_url)
            print(f"{time.monotonic() - started:.0f} s: {done}/{total} rollouts, {kept} kept, {trained} trained, "
                  f"checkpoint v{latest}, server v{held}", flush=True)
            if done >= total and credited >= calls and trained >= kept and held >= latest:
                break
            if time.monotonic() - started > args.timeout:
                raise TimeoutError(f"not done after {args.timeout:.0f} s (see the logs in {session.workdir})")
            await asyncio.sleep(2.0)
        seconds = time.monotonic() - started
        after = await evaluate(AGENT, heldout, session.proxy_url, session.proxy_key, session.server_url, 0.0)
        print(f"held-out after: {after.accuracy:.1%} ({after.correct}/{after.total}, v{after.policy_version})",
              flush=True)
    finally:
        set_sink(None)
        await asyncio.to_thread(publisher.close)
    steps, step_seconds, trained = client.query(
        "SELECT count(), sum(step_time_s), sum(transitions) FROM train_steps FINAL").result_rows[0]
    sampled_success = scalar(client, f"SELECT avg(final_reward >= {args.min_reward}) FROM rollouts FINAL "
                                     f"WHERE agent_name = '{name}'")
    kept_rollouts = scalar(client, f"SELECT count() FROM rollouts FINAL WHERE agent_name = '{name}' "
                                   f"AND final_reward >= {args.min_reward}")
    emit(BENCH, "heldout_before", before.accuracy, "accuracy", correct=before.correct, tasks=before.total,
         interval95=wilson_interval(before.accuracy, before.total), judged=AGENT.judged)
    emit(BENCH, "sampled", done, "rollouts", prompts=args.prompts, per_prompt=args.samples,
         temperature=AGENT.temperature, success=round(sampled_success, 4), kept_rollouts=kept_rollouts,
         kept_transitions=kept, min_reward=args.min_reward)
    emit(BENCH, "supervised_steps", steps, "steps", trained_transitions=trained, step_seconds=round(step_seconds, 1),
         lr=args.lr, batch=args.batch, policy_version=after.policy_version,
         sampling_and_training_s=round(seconds, 1))
    emit(BENCH, "heldout_after", after.accuracy, "accuracy", before=before.accuracy, correct=after.correct,
         tasks=after.total, interval95=wilson_interval(after.accuracy, after.total))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="Train tasks sampled.")
    parser.add_argument("--samples", type=int, default=8, help="Rollouts per train task (one GRPO group).")
    parser.add_argument("--min-reward", type=float, default=1.0, help="Keep rollouts with at least this reward.")
    parser.add_argument("--batch", type=int, default=16, help="Kept transitions per supervised step.")
    parser.add_argument("--lr", type=float, default=3e-5, help="The supervised steps' learning rate.")
    parser.add_argument("--heldout", type=int, default=64, help="Held-out tasks (the demo's 64 by default).")
    parser.add_argument("--timeout", type=float, default=480.0, help="Seconds allowed to sample and train.")
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
            server_threads=config.demo.server_threads))
        try:
            session.start(progress=print)
            asyncio.run(measure(config, endpoints, session, client, args))
        finally:
            session.stop()
            client.close()


if __name__ == "__main__":
    main()
