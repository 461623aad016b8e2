"""The main job: train SmolLM2-135M-Instruct online on an example agent, end to end, and prove it learned.

Stack up; the agent (``examples/arithmetic.py`` by default, plain OpenAI SDK; or the multi-step
``examples/calculator_agent.py``, whose rollouts are trained at trajectory level after a warm
start on demonstrations sent through the same pipeline) runs in runner processes
through the capturing proxy against the dev model server; streams assign GRPO credit; the
trainer steps and checkpoints; hot swap loads every checkpoint into the server while the
runners keep going. Held-out greedy accuracy is measured before, every ``eval_every_s`` and
after, through the same proxy under a separate agent name (captured, never trained on). A caller
that evaluates afterwards (``make bench-learning``) asks for snapshots instead of the evaluations
during training: the weights the server held every ``eval_every_s``, kept as hard links, so the
evaluation takes no CPU from the run and can use more tasks.
Writes ``demo-report.json``, a plot and a Markdown report, then stops what it started. With
``[tracking] mlflow_uri`` the held-out accuracies also go into the trainer's MLflow run
(``heldout_accuracy`` at step = policy version).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from agentstream.console import product_console
from agentstream.dashboard.server import start_beside
from agentstream.demo.agents import AGENTS, DemoAgent, on_framework
from agentstream.demo.clock import StallWatch, TrainingClock
from agentstream.demo.results import DemoReport, Evaluation, Snapshot, write_markdown, write_plot
from agentstream.demo.warm_start import FOLDER as WARM_START_FOLDER
from agentstream.demo.warm_start import (
    WarmStartMismatch,
    WarmStartNotSaved,
    WarmStartPlan,
    WarmStartSettings,
    install_warm_start,
    load_warm_start,
    served_saved,
    warm_start,
)
from agentstream.infra.clickhouse import ROLLOUT_POLICY_VERSION, PatientReads, connect, migrate
from agentstream.infra.config import Config, CreditRule
from agentstream.models import local_path
from agentstream.models.precision import native_bfloat16
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.runner.tasks import PacedQueue, grouped_tasks
from agentstream.pipeline.sdk import emit_reward, rollout, set_sink
from agentstream.schemas.contracts import POLICY_VERSION_HEADER
from agentstream.session import SessionPlan, TrainingSession
from agentstream.stack.control import Stack
from agentstream.stack.machine import calibrate
from agentstream.trainer.checkpoint_writer import find_version, keep_only_newest, open_store
from agentstream.trainer.policy import OPTIMIZER_STATE
from agentstream.trainer.tracking import record_evaluations

DATABASE = "agentstream_demo"
GROUP_TIMEOUT_S = 120.0  # a GRPO group is credited this long after its first rollout ended, complete or not
EXPLORE_COMMAND = f"agentstream up && CLICKHOUSE_DATABASE={DATABASE} agentstream report"
"""What the demo's last line gives the user to paste: the stack back up, the run's numbers read from it."""
RATE_WINDOW_S = 30.0
PACE_EVERY_S = 0.2  # how soon a new policy version lets the next wave out (a /health call a time)
SNAPSHOT_EVERY_S = 3.0  # the live numbers from ClickHouse
LAST_VERSIONS = 5  # the policy versions whose train rollouts say how many LLM calls a rollout makes at the end


def compute_dtype(config: Config) -> str:
    """The demo's compute dtype for its server and trainer (``[demo] dtype``, see
    ``agentstream.demo.settings.DemoConfig``)."""
    if config.demo.dtype != "auto":
        return config.demo.dtype
    return "bfloat16" if native_bfloat16(config.trainer.device) else "float32"


def demo_config(config: Config, run_id: str, workdir: Path, agent: DemoAgent = AGENTS["arithmetic"]) -> Config:
    """The demo's settings on top of the user's: its own topics and database, GRPO on the train agent only.

    An agent with a warm start also trains on its demonstrations (final reward 1: advantage 1). The
    trainer's objective is ``[demo] objective`` (the supervised control keeps the same credit rules:
    it trains the rollouts that succeeded by likelihood, whatever their advantage).
    """
    demo = config.demo
    wave = demo.group_size * demo.prompts_per_wave
    dtype = compute_dtype(config)
    return replace(
        config,
        server=replace(config.server, dtype=dtype),
        topics=replace(config.topics, prefix=f"demo-{run_id}.", partitions=1),
        clickhouse=replace(config.clickhouse, database=DATABASE),
        streams=replace(config.streams, app_id=f"agentstream-demo-{run_id}"),
        credit=(CreditRule(agent=agent.name, strategy=agent.strategy, gamma=agent.gamma, group_size=demo.group_size,
                           group_timeout_s=GROUP_TIMEOUT_S,
                           keep_flat_groups=True,  # the trainer steps once per wave, its flat groups counted
                           level=agent.level),
                *((CreditRule(agent=agent.demonstrations_name, strategy="final", level=agent.level),)
                  if agent.warm_start else ()),
                CreditRule(agent="*", train=False)),
        trainer=replace(config.trainer, model="smollm2", objective=demo.objective, threads=demo.trainer_threads,
                        dtype=dtype,
                        checkpoint_dtype=dtype,  # the server computes in it: half the bytes per version in bfloat16
                        lr=demo.lr, temperature=agent.temperature, batch_transitions=agent.samples_per_step or wave,
                        batch_counts_skipped=True,
                        batch_tokens=0,
                        micro_batch_tokens=agent.micro_batch_tokens,
                        # a step holds its whole wave: its groups reach the trainer minutes apart on 2 cores, and at
                        # 15 s each group made a step (and a version, which let the next wave out too early)
                        batch_wait_s=GROUP_TIMEOUT_S,
                        max_policy_lag=demo.max_policy_lag, checkpoint_every_steps=1, keep_checkpoints=3,
                        # a warm start is saved with AdamW's moments (2 s and 1 GB a version on a CPU): a run started
                        # from it without them took a first step of lr on every weight, and sampled ~0% for a version
                        optimizer_state_every=int(agent.warm_start and not demo.warm_start_from),
                        checkpoint_dir=str(workdir / "checkpoints"), session_timeout_s=6.0),
    )


def new_run(config: Config, kind: str = "demo") -> tuple[str, Path]:
    """A run id and the run's own folder under the stack home (its logs, checkpoints and journal)."""
    run_id = uuid.uuid4().hex[:8]
    workdir = config.stack.home.resolve() / kind / run_id
    workdir.mkdir(parents=True, exist_ok=True)
    return run_id, workdir


def fresh_database(config: Config, clickhouse_url: str, console: Console) -> PatientReads:
    """The demo's own database (the one ``config`` names), dropped and created afresh each run, read patiently: on
    a slow machine training can starve ClickHouse's answers."""
    database = config.clickhouse.database
    server = connect(config.clickhouse, clickhouse_url, database="default")
    server.command(f"DROP DATABASE IF EXISTS {database}")
    migrate(server, database)
    server.close()
    return PatientReads(connect(config.clickhouse, clickhouse_url, database=database), console.print)


def server_version(server_url: str) -> int:
    """The policy version the model server holds now (every response carries it)."""
    with urllib.request.urlopen(server_url + "/health", timeout=10) as response:
        return int(response.headers[POLICY_VERSION_HEADER])


async def evaluate(agent: DemoAgent, tasks: list[dict], proxy_url: str, proxy_key: str | None,
                   served_version: Callable[[], int], at: float, model: str | None = None) -> Evaluation:
    """Held-out success on ``tasks`` at the agent's evaluation temperature (greedy by default), ``eval_samples``
    rollouts per task, each captured under the agent's eval name (presenting ``proxy_key``); ``at`` is the
    training clock's seconds it is recorded at, ``served_version`` says which version the server holds.
    ``model``: the trained model the tasks call (one of several the server answers to)."""
    version = await asyncio.to_thread(served_version)

    async def one(task: dict) -> float:
        async with rollout(agent.eval_name, task_id=task["id"], proxy_url=proxy_url, proxy_key=proxy_key) as state:
            reward = await agent.solve(task, state, temperature=agent.eval_temperature)
            emit_reward(reward)  # so held-out accuracy per policy version is queryable too
            return reward

    named = [{**task, "model": model} if model else task for task in tasks]
    rewards = await asyncio.gather(*(one(task) for task in named for _ in range(agent.eval_samples)))
    correct, total = int(sum(rewards)), len(rewards)
    return Evaluation(round(at, 1), version, correct / total, correct, total)


def snapshot_served(server_url: str, checkpoint_dir: str, folder: Path, seconds: float) -> Snapshot:
    """Hard-link the weights the server holds now into ``folder`` (the trainer prunes its own copies)."""
    version = server_version(server_url)
    if version == 0:
        return Snapshot(seconds, 0, "")
    manifest = find_version(open_store(checkpoint_dir), version)
    source = local_path(manifest.uri) / manifest.weights_file
    target = folder / f"{seconds:07.1f}s-v{version}-{manifest.weights_file}"
    os.link(source, target)
    return Snapshot(seconds, version, str(target))


def waves(train: list[dict], group_size: int, wave_size: int, agent: DemoAgent, model: str | None = None):
    """Endless shuffled passes over the train tasks, as waves of GRPO groups for the train agent at its temperature.

    Each task names its agent (``solve_named`` dispatches on it) and, with ``model``, the trained model it calls.
    """
    rng = random.Random(0)
    while True:
        epoch = [{**task, "temperature": agent.temperature, "agent": agent.name, **({"model": model} if model else {})}
                 for task in train]
        rng.shuffle(epoch)
        tasks = grouped_tasks(epoch, group_size=group_size, agent_name=agent.name, timeout_s=600)
        for start in range(0, len(tasks) - wave_size + 1, wave_size):
            yield tasks[start:start + wave_size]


class Dashboard:
    """Live numbers from ClickHouse: the same tables `agentstream sql` and `report` read."""

    def __init__(self, client, console: Console, budget: str, agent: DemoAgent, model: str | None = None) -> None:
        self.client, self.console, self.budget, self.agent = client, console, budget, agent
        self.of_model = f" WHERE model = '{model}'" if model else ""  # one trained model of several
        self.evaluations: list[Evaluation] = []
        self.history: deque[tuple[float, int, int]] = deque()
        self.rates = (0.0, 0.0)

    def snapshot(self) -> dict:
        rollouts, spans = self.client.query(
            f"SELECT (SELECT count() FROM rollouts FINAL WHERE agent_name = '{self.agent.name}'), "
            "(SELECT count() FROM spans)").result_rows[0]
        steps = self.client.query(
            f"SELECT count(), (SELECT max(version) FROM checkpoints FINAL{self.of_model}), "
            f"argMax(staleness_mean, step), argMax(reward_mean, step) FROM train_steps FINAL{self.of_model}"
        ).result_rows[0]
        now = time.monotonic()
        self.history.append((now, rollouts, spans))
        while len(self.history) > 2 and now - self.history[1][0] >= RATE_WINDOW_S:
            self.history.popleft()
        then, rollouts_then, spans_then = self.history[0]
        if now > then:
            self.rates = ((rollouts - rollouts_then) / (now - then), (spans - spans_then) / (now - then))
        return {"rollouts": rollouts, "spans": spans, "steps": steps[0], "version": steps[1] if steps[0] else 0,
                "staleness": steps[2] if steps[0] else 0.0, "last_reward": steps[3] if steps[0] else None}

    def finished_groups(self, groups: set[str], group_size: int) -> dict[str, bool]:
        """Of ``groups``, those whose rollouts have all been rewarded, each with whether it was flat."""
        if not groups:
            return {}
        listed = ", ".join("'" + group.replace("\\", "\\\\").replace("'", "\\'") + "'" for group in groups)
        rows = self.client.query(
            f"SELECT group_id, min(final_reward) = max(final_reward) FROM rollouts FINAL "
            f"WHERE agent_name = '{self.agent.name}' AND group_id IN ({listed}) AND final_reward IS NOT NULL "
            f"GROUP BY group_id HAVING count() = {int(group_size)}").result_rows
        return {group: bool(flat) for group, flat in rows}

    def reward_per_version(self) -> list[dict]:
        rows = self.client.query(
            f"SELECT {ROLLOUT_POLICY_VERSION} AS version, count() AS rollouts, avg(final_reward) AS reward, "
            "avg(llm_calls) AS calls, sum(prefix_merges), sum(prefix_breaks) "
            f"FROM rollouts FINAL WHERE agent_name = '{self.agent.name}' AND notEmpty(policy_versions) "
            "AND final_reward IS NOT NULL "  # a rollout the stopped runners cut short has none
            "GROUP BY version ORDER BY version").result_rows
        return [{"policy_version": v, "rollouts": n, "reward_mean": round(r, 4), "llm_calls_mean": round(c, 3),
                 "prefix_merges": merges, "prefix_breaks": breaks} for v, n, r, c, merges, breaks in rows]

    def heldout_calls(self, judged: Evaluation, stalled_s: float = 60.0) -> float | None:
        """LLM calls per held-out rollout of the version ``judged`` evaluated (rollouts under the agent's eval
        name), once the stream processors have written all that evaluation's rollouts with their rewards.

        They finish the evaluation's spans after it returns, later on a loaded machine (seen: 2 of 64 written a
        minute after), so this waits as long as they make progress; None once ``stalled_s`` pass without any.
        """
        written_before, progressed = -1, time.monotonic()
        while True:
            calls, written = self.client.query(
                f"SELECT avg(llm_calls), count() FROM rollouts FINAL WHERE agent_name = '{self.agent.eval_name}' "
                f"AND {ROLLOUT_POLICY_VERSION} = {int(judged.policy_version)} AND final_reward IS NOT NULL"
            ).result_rows[0]
            if written >= judged.total:
                return round(calls, 3)
            if written > written_before:
                written_before, progressed = written, time.monotonic()
            elif time.monotonic() - progressed > stalled_s:
                self.console.print(f"[yellow]{written} of the {judged.total} held-out rollouts of "
                                   f"v{judged.policy_version} written after {stalled_s:.0f} s without another; the "
                                   "report leaves out their LLM calls[/yellow]")
                return None
            time.sleep(1.0)

    def render(self, elapsed: float, numbers: dict, per_version: list[dict]) -> Table:
        table = Table(title=f"agentstream demo: training {elapsed:.0f} s (budget {self.budget})", show_header=False)
        table.add_row("rollouts/s, spans/s", f"{self.rates[0]:.1f}, {self.rates[1]:.1f}  "
                      f"({numbers['rollouts']} rollouts, {numbers['spans']} spans)")
        table.add_row("policy version", f"v{numbers['version']}  ({numbers['steps']} optimizer steps)")
        table.add_row("lag (versions behind, last step)", f"{numbers['staleness']:.2f}")
        recent = "  ".join(f"v{row['policy_version']}:{row['reward_mean']:.2f}" for row in per_version[-8:])
        table.add_row("sampled reward per version", recent or "-")
        table.add_row(f"held-out {self.agent.judged} accuracy", "  ".join(
            f"v{e.policy_version}:{e.accuracy:.0%}" for e in self.evaluations) or "-")
        return table

    def line(self, elapsed: float, numbers: dict, per_version: list[dict]) -> str:
        reward = per_version[-1]["reward_mean"] if per_version else float("nan")
        held = self.evaluations[-1].accuracy if self.evaluations else float("nan")
        return (f"[{elapsed:5.0f}s] {numbers['rollouts']} rollouts ({self.rates[0]:.1f}/s), {numbers['spans']} spans "
                f"({self.rates[1]:.0f}/s), policy v{numbers['version']}, lag {numbers['staleness']:.2f}, "
                f"sampled reward {reward:.2f}, held-out {held:.0%}")


def warm_start_settings(config: Config, agent: DemoAgent) -> WarmStartSettings:
    """What this run's warm start depends on (a saved one serves a run whose settings are the same)."""
    return WarmStartSettings(agent=agent.name, framework=agent.framework,
                             demonstrations=config.demo.warm_start_demonstrations or agent.demonstrations,
                             dtype=compute_dtype(config), heldout_tasks=config.demo.heldout_tasks)


async def train_and_watch(session: TrainingSession, config: Config, endpoints, client, console: Console,
                          snapshots: Path | None, agent: DemoAgent = AGENTS["arithmetic"],
                          warm: WarmStartPlan | None = None, *, stall: StallWatch,
                          ) -> tuple[list[Evaluation], list[Snapshot], TrainingClock, float | None]:
    """Enqueue the train tasks, run RL until its time is up (or the target is reached, or ``stall`` says no
    version comes any more), evaluating as it goes.

    An agent with a warm start (``warm``) trains on its demonstrations first, or starts from a saved
    warm start (installed in the trainer's store) once the server holds it, and is evaluated after it;
    all before RL's clock starts. Held-out evaluations during RL are kept off its clock too
    (:class:`TrainingClock`). With ``snapshots``, the served weights are linked there every
    ``eval_every_s`` instead of evaluated. Returns the evaluations, the snapshots, RL's clock and the
    warm start's seconds (None without one).
    """
    demo = config.demo
    saved = warm.saved if warm else None
    train, heldout = agent.module.split(heldout=demo.heldout_tasks)
    warm_seconds: float | None = None
    taken: list[Snapshot] = []
    publisher = SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=session.workdir / "journal").start()
    set_sink(publisher)
    try:
        session.start_runners(progress=console.print)  # they join the task queue while the base model is evaluated
        served = partial(server_version, session.server_url)
        before = saved.before if saved else await evaluate(agent, heldout, session.proxy_url, session.proxy_key,
                                                           served, 0.0)
        console.print(f"held-out before training: {before.accuracy:.1%} ({before.correct}/{before.total}, "
                      f"{agent.judged}, policy v{before.policy_version})"
                      f"{', measured by the run that saved the warm start' if saved else ''}")
        dashboard = Dashboard(client, console, demo.budget, agent)
        dashboard.evaluations.append(before)
        if warm:
            to_save: int | None = None  # the version of a warm start made here (a saved one is not saved again)
            if saved:
                warm_seconds = saved.seconds
                await served_saved(saved, served, session, console)
            else:
                warm_seconds, to_save = await warm_start(agent, train, config, session, client, console, served)
            warmed = await evaluate(agent, heldout, session.proxy_url, session.proxy_key, served, 0.0)
            dashboard.evaluations.append(warmed)
            console.print(f"held-out after the warm start: {warmed.accuracy:.1%} ({warmed.correct}/{warmed.total}, "
                          f"{agent.judged}, policy v{warmed.policy_version}); "
                          f"{'RL' if demo.objective == 'policy_gradient' else 'the supervised control'} from here")
            if to_save is not None:
                try:
                    kept = await asyncio.to_thread(warm.save, open_store(config.trainer.checkpoint_dir), to_save,
                                                   warm_seconds, before, warmed)
                    console.print(f"warm start saved in {kept}: start RL, or the control, from it again with "
                                  f"--warm-start-from {kept}")
                except WarmStartNotSaved as error:  # a copy for later runs: this run trains on without it
                    console.print(f"[yellow]{error}; the demo goes on without it[/yellow]")
        wave_size = demo.group_size * demo.prompts_per_wave
        held = start = await asyncio.to_thread(served)
        queue = await PacedQueue(config, endpoints.bootstrap_servers,
                                 waves(train, demo.group_size, wave_size, agent),
                                 max_lag=demo.max_policy_lag).start()
        clock = TrainingClock()
        try:
            await queue.top_up(held, 0, time.monotonic())
            next_eval = demo.eval_every_s  # on the clock
            pending: asyncio.Task | None = None
            last_line = last_snapshot = 0.0
            numbers: dict = {}
            with (Live(console=console, refresh_per_second=2, transient=False) if console.is_terminal
                  else nullcontext()) as live:
                while not demo.spent(elapsed := clock.elapsed(), held - start):
                    session.check()
                    if time.monotonic() - last_snapshot >= SNAPSHOT_EVERY_S:
                        numbers, per_version = dashboard.snapshot(), dashboard.reward_per_version()
                        queue.settle(dashboard.finished_groups(queue.unsettled_groups(), demo.group_size))
                        last_snapshot = time.monotonic()
                        if live is not None:  # a terminal
                            live.update(dashboard.render(elapsed, numbers, per_version))
                        elif time.monotonic() - last_line >= 15:
                            console.print(dashboard.line(elapsed, numbers, per_version))
                            last_line = time.monotonic()
                    held = await asyncio.to_thread(served)
                    if stall.check(held, clock.elapsed()):
                        console.print(f"[yellow]RL ended early: {stall.describe()}[/yellow]")
                        break
                    await queue.top_up(held, numbers.get("rollouts", 0), time.monotonic())
                    if pending is not None and pending.done():
                        clock.release()
                        result = pending.result()
                        dashboard.evaluations.append(result)
                        console.print(f"held-out at {result.seconds:.0f} s: {result.accuracy:.1%} "
                                      f"(policy v{result.policy_version})")
                        pending = None
                        if demo.stop_at_target and result.accuracy >= demo.target:
                            break
                    if snapshots is not None and clock.elapsed() >= next_eval:
                        taken.append(await asyncio.to_thread(
                            snapshot_served, session.server_url, config.trainer.checkpoint_dir, snapshots,
                            round(clock.elapsed(), 1)))
                        next_eval += demo.eval_every_s
                    elif pending is None and clock.elapsed() >= next_eval:
                        pending = asyncio.create_task(evaluate(agent, heldout, session.proxy_url,
                                                               session.proxy_key, served, clock.elapsed()))
                        clock.hold()
                        next_eval = clock.elapsed() + demo.eval_every_s
                    await asyncio.sleep(PACE_EVERY_S)
        finally:
            await queue.close()
        if pending is not None:
            dashboard.evaluations.append(await pending)
            clock.release()
        clock.hold()  # RL is over: what follows is off its clock
        training_seconds = clock.elapsed()
        if snapshots is not None:
            taken.append(await asyncio.to_thread(snapshot_served, session.server_url, config.trainer.checkpoint_dir,
                                                 snapshots, round(training_seconds, 1)))
        console.print("stopping runners and trainer, then the final held-out evaluation")
        session.stop(*(name for name in session.children if name.startswith("runner")), "trainer")
        await asyncio.sleep(2.0)  # the last announced checkpoint reaches the server
        after = await evaluate(agent, heldout, session.proxy_url, session.proxy_key, served, training_seconds)
        dashboard.evaluations.append(after)
        console.print(f"held-out after training: {after.accuracy:.1%} ({after.correct}/{after.total}, "
                      f"{agent.judged}, policy v{after.policy_version})")
        return dashboard.evaluations, taken, clock, warm_seconds
    finally:
        set_sink(None)
        await asyncio.to_thread(publisher.close)


def run_demo(config: Config, console: Console | None = None, snapshots: Path | None = None,
             agent: DemoAgent | str = "arithmetic", framework: str = "openai") -> DemoReport:
    """The whole demo on an agent (one of :data:`AGENTS` by name) written on ``framework``; returns (and writes)
    its report.

    ``snapshots``: a folder for the served weights over time.
    """
    config.demo.refuse_ignored_settings()
    agent = on_framework(AGENTS[agent] if isinstance(agent, str) else agent, framework)
    console = console or product_console()
    started = time.monotonic()
    run_id, workdir = new_run(config)
    config = demo_config(config, run_id, workdir, agent)
    demo = config.demo
    control = demo.objective == "supervised"
    console.rule(f"agentstream demo: {agent.name}{'' if agent.framework == 'openai' else ' on ' + agent.framework}"
                 f"{' (the supervised control)' if control else ''} ({'quick, ' if demo.quick else ''}{demo.budget} "
                 f"of {'supervised steps' if control else 'RL'})")
    machine = calibrate()
    console.print(f"machine: {machine.describe()} (docs/demo.md's figures name theirs: a slower machine learns "
                  "slower in the same minutes)")
    warm = None
    if demo.warm_start_from and not agent.warm_start:
        raise WarmStartMismatch(f"--warm-start-from: the {agent.name} agent has no warm start")
    if agent.warm_start:
        settings = warm_start_settings(config, agent)
        warm = WarmStartPlan(settings, machine.as_dict(), Path(demo.output_dir) / WARM_START_FOLDER,
                             load_warm_start(Path(demo.warm_start_from), settings) if demo.warm_start_from else None)
    console.print(f"precision: {config.trainer.dtype} compute, float32 weights (demo.dtype {demo.dtype!r}: "
                  "bfloat16 where the device multiplies it natively)")
    stack = Stack(config)
    endpoints = stack.up(progress=console.print)
    session = TrainingSession(config, endpoints, workdir, SessionPlan(
        agent=agent.entry, model="smollm2", concurrency=demo.group_size * demo.prompts_per_wave,
        server_threads=demo.server_threads))
    live_dashboard = start_beside(config, endpoints, console.print)  # up while the demo runs
    try:
        client = fresh_database(config, endpoints.clickhouse_url, console)
        if warm and warm.saved:
            copied = install_warm_start(Path(demo.warm_start_from), warm.saved,
                                        open_store(config.trainer.checkpoint_dir), demo.warm_start_momentum)
            console.print(f"warm start: v{copied.version} copied from {demo.warm_start_from}; the trainer starts "
                          "from it, without the demonstrations" + ("" if demo.warm_start_momentum else
                                                                   ", and without AdamW's first moment"))
        session.start(progress=console.print)
        if snapshots is not None:
            snapshots.mkdir(parents=True, exist_ok=True)
        stall = demo.stall_watch()
        evaluations, taken, clock, warm_seconds = asyncio.run(
            train_and_watch(session, config, endpoints, client, console, snapshots, agent, warm, stall=stall))
        if config.tracking.mlflow_uri:  # into the trainer's run, beside its per-step metrics
            console.print(record_evaluations(config.tracking, config.trainer.checkpoint_dir,
                                             [(e.policy_version, e.accuracy) for e in evaluations]))
        dashboard = Dashboard(client, console, demo.budget, agent)
        numbers = dashboard.snapshot()
        reached = [e.seconds for e in evaluations if e.seconds >= 0 and e.accuracy >= demo.target]
        per_version = dashboard.reward_per_version()
        last = per_version[-LAST_VERSIONS:]
        tokens, step_seconds = client.query(
            "SELECT sum(tokens), sum(step_time_s) FROM train_steps FINAL").result_rows[0]
        report = DemoReport(
            agent=agent.name, framework=agent.framework, judged=agent.judged, objective=demo.objective,
            heldout_warm_start=evaluations[1].accuracy if agent.warm_start else None,
            warm_start_seconds=round(warm_seconds, 1) if warm_seconds is not None else None,
            warm_start_from=demo.warm_start_from,
            llm_calls_per_rollout=(round(sum(r["llm_calls_mean"] * r["rollouts"] for r in last)
                                         / sum(r["rollouts"] for r in last), 3) if last else None),
            heldout_llm_calls_per_rollout=dashboard.heldout_calls(evaluations[-1]),
            prefix_merges=sum(r["prefix_merges"] for r in per_version),
            prefix_breaks=sum(r["prefix_breaks"] for r in per_version),
            train_tokens_per_s=round(tokens / step_seconds, 1) if step_seconds else None,
            heldout_before=evaluations[0].accuracy, heldout_after=evaluations[-1].accuracy,
            policy_versions=numbers["version"], seconds=round(time.monotonic() - started, 1),
            training_seconds=round(clock.elapsed(), 1), budget=demo.budget, stalled=stall.stalled,
            evaluation_seconds=round(clock.paused, 1),
            time_to_target_s=min(reached) if reached else None,
            target=demo.target, evaluations=evaluations, reward_per_version=per_version,
            rollouts=numbers["rollouts"], spans=numbers["spans"], train_steps=numbers["steps"], quick=demo.quick,
            machine=machine.as_dict(), snapshots=taken)
    finally:
        if live_dashboard is not None:
            live_dashboard.stop()
        session.stop()
        stack.down(progress=console.print)
        checkpoints = Path(config.trainer.checkpoint_dir)
        if checkpoints.is_dir():
            for folder in keep_only_newest(open_store(str(checkpoints)), drop_files=(OPTIMIZER_STATE,)):
                console.print(f"final weights kept in {folder} (earlier checkpoints and the optimizer state removed)")
    output = Path(demo.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    Path(demo.report_path).write_text(json.dumps(asdict(report), indent=2) + "\n")
    write_plot(output / "reward_per_version.png", report, agent.title)
    write_markdown(output / "report.md", report)
    console.print(f"held-out {agent.judged} accuracy {report.heldout_before:.1%} -> {report.heldout_after:.1%} "
                  f"over {report.policy_versions} policy versions in {report.training_seconds:.0f} s of training "
                  f"({report.seconds:.0f} s in all)")
    console.print(f"wrote {demo.report_path}, {output / 'report.md'}, {output / 'reward_per_version.png'}; "
                  f"logs in {workdir}")
    console.print(f"explore the run: {EXPLORE_COMMAND}")
    return report
