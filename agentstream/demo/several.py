"""Several agents learning at once through one stack, each into its own LoRA adapter of one base model.

``agentstream demo --agents arithmetic,calculator``: every agent has its own tasks, reward and
``[[credit]]`` rules, its own trained model (``smollm2-<agent>``, :func:`model_of`), trainer,
checkpoints, hot swap and deployments; one model server answers to every trained model by name
and keeps one copy of the base weights (``--served-model-name``, one per agent). One runner
process serves every agent's tasks (:func:`agentstream.demo.agents.solve_named`). Held-out
success is measured per agent before, every ``eval_every_s`` of RL and after, as the one-agent
demo does, all agents at once and off RL's clock. The report adds the model server's resident
memory and the number of LLM calls answered by another agent's adapter (there should be none).
The same command with one agent is that agent trained alone, the comparison for its gain.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

from rich.console import Console

from agentstream.console import product_console
from agentstream.demo.agents import AGENTS, DemoAgent, as_adapter
from agentstream.demo.clock import StallWatch, TrainingClock
from agentstream.demo.online import ALL_LINEAR
from agentstream.demo.results import Evaluation
from agentstream.demo.training import (
    PACE_EVERY_S,
    SNAPSHOT_EVERY_S,
    Dashboard,
    demo_config,
    evaluate,
    fresh_database,
    new_run,
    waves,
)
from agentstream.demo.warm_start import warm_start
from agentstream.deploy.deployments import split_adapter_name
from agentstream.infra.config import Config, CreditRule
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.runner.tasks import PacedQueue
from agentstream.pipeline.sdk import set_sink
from agentstream.session import SessionPlan, TrainingSession
from agentstream.stack.control import Stack
from agentstream.stack.machine import calibrate, resident_mb

RUNNER_ENTRY = "agentstream.demo.agents:solve_named"
REPORT_PATH = "several-report.json"
LINE_EVERY_S = 15.0


def model_of(agent: DemoAgent) -> str:
    """The trained model an agent calls and trains: its adapter's name on the shared server."""
    return f"smollm2-{agent.name}"


def several_config(config: Config, run_id: str, workdir: Path, agents: list[DemoAgent]) -> Config:
    """The session's configuration: the demo's topics and database, every agent's credit rules, LoRA training.

    Each agent's rules are the one-agent demo's, with its calls trained as its own model (``train_as``),
    so that its transitions reach its trainer only.
    """
    rules = [replace(rule, train_as=model_of(agent))
             for agent in agents for rule in demo_config(config, run_id, workdir, agent).credit if rule.agent != "*"]
    shared = demo_config(config, run_id, workdir, agents[0])
    return replace(shared, credit=(*rules, CreditRule(agent="*", train=False)),
                   trainer=replace(shared.trainer, lora=True, lora_target_modules=ALL_LINEAR,
                                   optimizer_state_every=0))  # no warm start is saved


def adapter_lr(config: Config, agent: DemoAgent) -> float:
    """The learning rate of an agent's adapter: ``[demo] adapter_lr`` where set, else the agent's own."""
    return config.demo.adapter_lr or agent.adapter_lr


def trainer_config(shared: Config, run_id: str, workdir: Path, agent: DemoAgent) -> Config:
    """One agent's trainer: its model's transitions into its own adapter and checkpoints, at its batch,
    temperature and learning rate (``[demo] adapter_lr``, else the agent's own)."""
    own = demo_config(shared, run_id, workdir, agent).trainer
    return replace(shared, trainer=replace(
        shared.trainer, model_name=model_of(agent), temperature=own.temperature,
        lr=adapter_lr(shared, agent),
        batch_transitions=own.batch_transitions, micro_batch_tokens=own.micro_batch_tokens,
        checkpoint_dir=str(workdir / "checkpoints" / agent.name)))


def adapter_version(server_url: str, model: str) -> int:
    """The newest version of ``model``'s adapters the server holds (0: none yet, the base weights answer)."""
    with urllib.request.urlopen(server_url + "/v1/models", timeout=10) as response:
        listed = json.load(response)["data"]
    return max((version for name, version in (split_adapter_name(entry["id"]) for entry in listed)
                if name == model and version is not None), default=0)


@dataclass
class Learner:
    """One agent of several: its trained model, its tasks, the version the server holds of it, its held-out curve."""

    agent: DemoAgent
    model: str
    train: list[dict]
    heldout: list[dict]
    served: Callable[[], int]
    dashboard: Dashboard
    stall: StallWatch
    numbers: dict = field(default_factory=dict)

    async def evaluate(self, session: TrainingSession, at: float) -> Evaluation:
        result = await evaluate(self.agent, self.heldout, session.proxy_url, session.proxy_key, self.served, at,
                                self.model)
        self.dashboard.evaluations.append(result)
        return result


@dataclass
class AgentResult:
    """One agent's figures in ``several-report.json``."""

    agent: str
    model: str
    adapter_lr: float
    heldout_before: float
    heldout_warm_start: float | None
    heldout_after: float
    policy_versions: int
    train_steps: int
    rollouts: int
    wrong_adapter_calls: int
    stalled: bool  # its budget in steps ended unspent: no new version for [demo] stall_limit_s
    evaluations: list[Evaluation]
    reward_per_version: list[dict]


@dataclass
class SeveralReport:
    """What ``several-report.json`` holds: per agent, and the shared model server's memory."""

    agents: list[AgentResult]
    training_seconds: float
    seconds: float
    server_rss_mb_base: float  # before any adapter was loaded
    server_rss_mb_peak: float
    machine: dict


def wrong_adapter_calls(client, agent: DemoAgent, model: str) -> int:
    """LLM calls of the agent's rollouts (train and held-out) answered as another trained model."""
    return int(client.query(
        f"SELECT count() FROM spans WHERE kind = 'LLM' AND agent_name IN ('{agent.name}', '{agent.eval_name}') "
        f"AND model != '{model}'").result_rows[0][0])


def _announce(console: Console, learners: list[Learner], what: str, results: list[Evaluation]) -> None:
    for learner, result in zip(learners, results, strict=True):
        console.print(f"{learner.agent.name}: held-out {what}: {result.accuracy:.1%} ({result.correct}/{result.total}, "
                      f"{learner.agent.judged}, {learner.model} v{result.policy_version})")


async def _learn(session: TrainingSession, config: Config, endpoints, learners: list[Learner], console: Console,
                 server_rss: Callable[[], float]) -> tuple[TrainingClock, float]:
    """Every agent's warm start (at once), then RL for all of them on one clock; returns it and the peak server RSS."""
    demo = config.demo
    wave_size = demo.group_size * demo.prompts_per_wave
    peak = server_rss()
    _announce(console, learners, "before training",
              await asyncio.gather(*(learner.evaluate(session, 0.0) for learner in learners)))
    warming = [learner for learner in learners if learner.agent.warm_start]
    if warming:
        await asyncio.gather(*(warm_start(learner.agent, learner.train, config, session, learner.dashboard.client,
                                          console, learner.served, learner.model) for learner in warming))
        _announce(console, warming, "after the warm start",
                  await asyncio.gather(*(learner.evaluate(session, 0.0) for learner in warming)))
    queues: list[PacedQueue] = []
    try:
        for learner in learners:
            queues.append(await PacedQueue(config, endpoints.bootstrap_servers,
                                           waves(learner.train, demo.group_size, wave_size, learner.agent,
                                                 learner.model), max_lag=demo.max_policy_lag).start())
        clock = TrainingClock()  # RL starts now
        peak = max(peak, await _rl(session, config, list(zip(learners, queues, strict=True)), clock, console,
                                   server_rss))
    finally:
        for queue in queues:
            await queue.close()
    clock.hold()  # RL is over
    peak = max(peak, server_rss())
    console.print("stopping the runner and the trainers, then the final held-out evaluations")
    session.stop(*(name for name in session.children if name.startswith(("runner", "trainer"))))
    await asyncio.sleep(2.0)  # the last announced checkpoints reach the server
    _announce(console, learners, "after training",
              await asyncio.gather(*(learner.evaluate(session, clock.elapsed()) for learner in learners)))
    return clock, peak


async def _rl(session: TrainingSession, config: Config, paced: list[tuple[Learner, PacedQueue]], clock: TrainingClock,
              console: Console, server_rss: Callable[[], float]) -> float:
    """RL for every agent until each has spent its budget, each agent's waves paced by its own adapter's version,
    the held-out evaluations of all agents at once every ``eval_every_s`` (off the clock); returns the peak RSS
    of the model server.

    An agent whose budget is spent (or whose versions stall: :class:`StallWatch`) gets no more waves and its
    trainer stops, as it would alone: with ``--steps 5`` the arithmetic agent's trainer went on to 7 steps on
    the waves already out while the calculator agent finished.
    """
    demo = config.demo
    learners = [learner for learner, _ in paced]
    starts = [await asyncio.to_thread(learner.served) for learner in learners]
    peak, next_eval, pending = 0.0, demo.eval_every_s, None
    last_snapshot = last_line = 0.0
    while True:
        held = [await asyncio.to_thread(learner.served) for learner in learners]
        going = [not demo.spent(clock.elapsed(), now - start) and not learner.stall.check(now, clock.elapsed())
                 for learner, now, start in zip(learners, held, starts, strict=True)]
        for learner, open_ in zip(learners, going, strict=True):
            if not open_ and f"trainer-{learner.agent.name}" in session.children:
                if learner.stall.stalled:
                    console.print(f"[yellow]{learner.agent.name}: RL ended early: {learner.stall.describe()}[/yellow]")
                await asyncio.to_thread(session.retire, f"trainer-{learner.agent.name}")
        if not any(going):
            break
        session.check()
        if time.monotonic() - last_snapshot >= SNAPSHOT_EVERY_S:
            peak = max(peak, server_rss())
            for learner, queue in paced:
                learner.numbers = learner.dashboard.snapshot()
                queue.settle(learner.dashboard.finished_groups(queue.unsettled_groups(), demo.group_size))
            last_snapshot = time.monotonic()
            if time.monotonic() - last_line >= LINE_EVERY_S:
                for learner in learners:
                    console.print(f"{learner.agent.name}: " + learner.dashboard.line(
                        clock.elapsed(), learner.numbers, learner.dashboard.reward_per_version()))
                last_line = time.monotonic()
        for (learner, queue), version, open_ in zip(paced, held, going, strict=True):
            if open_:
                await queue.top_up(version, learner.numbers.get("rollouts", 0), time.monotonic())
        if pending is not None and pending.done():
            clock.release()
            _announce(console, learners, f"at {clock.elapsed():.0f} s", pending.result())
            pending = None
        elif pending is None and clock.elapsed() >= next_eval:
            pending = asyncio.ensure_future(asyncio.gather(
                *(learner.evaluate(session, clock.elapsed()) for learner in learners)))
            clock.hold()
            next_eval = clock.elapsed() + demo.eval_every_s
        await asyncio.sleep(PACE_EVERY_S)
    if pending is not None:
        _announce(console, learners, f"at {clock.elapsed():.0f} s", await pending)
        clock.release()
    return peak


def run_several(config: Config, agents: list[str], console: Console | None = None) -> SeveralReport:
    """Train ``agents`` (names of :data:`AGENTS`) at once on one base model; returns (and writes) the report."""
    config.demo.refuse_ignored_settings(several=True)
    chosen = [as_adapter(AGENTS[name]) for name in agents]
    console = console or product_console()
    started = time.monotonic()
    run_id, workdir = new_run(config)
    config = several_config(config, run_id, workdir, chosen)
    models = tuple(model_of(agent) for agent in chosen)
    console.rule(f"agentstream demo: {', '.join(agents)} at once, each into its own adapter of one base model "
                 f"({config.demo.budget} of RL each)" if len(agents) > 1 else
                 f"agentstream demo: {agents[0]} alone, into its own adapter of the base model "
                 f"({config.demo.budget} of RL; the comparison for it trained with other agents)")
    machine = calibrate()
    console.print(f"machine: {machine.describe()}")
    stack = Stack(config)
    endpoints = stack.up(progress=console.print)
    session = TrainingSession(config, endpoints, workdir, SessionPlan(
        agent=RUNNER_ENTRY, model="smollm2", trainer=False, served_names=models,
        concurrency=config.demo.group_size * config.demo.prompts_per_wave * len(chosen),
        server_threads=config.demo.server_threads))
    try:
        client = fresh_database(config, endpoints.clickhouse_url, console)
        session.start(progress=console.print)
        server = session.children["model-server"].process
        assert server is not None  # started above
        base_rss = resident_mb(server.pid)
        for agent in chosen:
            session.start_trainer(f"trainer-{agent.name}", trainer_config(config, run_id, workdir, agent))
        console.print(f"trainers      one per agent, each into its adapter: {', '.join(models)}; the server held "
                      f"{base_rss:.0f} MB before any adapter")
        learners = []
        for agent, model in zip(chosen, models, strict=True):
            train, heldout = agent.module.split(heldout=config.demo.heldout_tasks)
            learners.append(Learner(agent, model, train, heldout, partial(adapter_version, session.server_url, model),
                                    Dashboard(client, console, config.demo.budget, agent, model),
                                    config.demo.stall_watch()))
        publisher = SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=workdir / "journal").start()
        set_sink(publisher)
        try:
            session.start_runners(progress=console.print)
            clock, peak = asyncio.run(_learn(session, config, endpoints, learners, console,
                                             partial(resident_mb, server.pid)))
        finally:
            set_sink(None)
            publisher.close()
        results = []
        for learner in learners:
            numbers = learner.dashboard.snapshot()
            evaluations = learner.dashboard.evaluations
            results.append(AgentResult(
                learner.agent.name, learner.model, adapter_lr(config, learner.agent), evaluations[0].accuracy,
                evaluations[1].accuracy if learner.agent.warm_start else None, evaluations[-1].accuracy,
                numbers["version"], numbers["steps"], numbers["rollouts"],
                wrong_adapter_calls(client, learner.agent, learner.model), learner.stall.stalled, evaluations,
                learner.dashboard.reward_per_version()))
        report = SeveralReport(results, round(clock.elapsed(), 1), round(time.monotonic() - started, 1),
                               round(base_rss, 1), round(peak, 1), machine.as_dict())
    finally:
        session.stop()
        stack.down(progress=console.print)
    Path(REPORT_PATH).write_text(json.dumps(asdict(report), indent=2) + "\n")
    for result in report.agents:
        warmed = f" -> {result.heldout_warm_start:.1%} warm" if result.heldout_warm_start is not None else ""
        console.print(f"{result.agent}: held-out {result.heldout_before:.1%}{warmed} -> {result.heldout_after:.1%} "
                      f"over {result.policy_versions} versions of {result.model}; {result.wrong_adapter_calls} calls "
                      "answered by another agent's adapter"
                      + ("; RL ended early, its versions stalled" if result.stalled else ""))
    console.print(f"model server: {report.server_rss_mb_base:.0f} MB before any adapter, "
                  f"{report.server_rss_mb_peak:.0f} MB at most; {report.training_seconds:.0f} s of RL, "
                  f"{report.seconds:.0f} s in all; wrote {REPORT_PATH}")
    return report
