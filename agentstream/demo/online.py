"""The online demo: a production service learns from its users' late feedback, and only gated checkpoints serve them.

On the embedded stack, in ``--contract vllm`` mode: SmolLM2 behind the proxy, a small HTTP
service (``POST /ask {"question"}``) answering with the arithmetic agent's prompt, one rollout
per request; simulated users asking at a steady rate and sending feedback for each answer
after a random delay (sometimes never) to the feedback URL the service gave them (the proxy's reward
endpoint with the rollout's feedback token); streams credit each
rollout against a running baseline when its feedback arrives; the trainer learns LoRA
adapters; every checkpoint is a candidate that the gate evaluates, canaries and promotes or
rolls back. Ends with a report: live success per minute and per served version, the
deployment decisions, the service's latency percentiles and its failed requests
(``online-report.json``, a PNG and the terminal).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.table import Table

from agentstream.console import product_console
from agentstream.dashboard.server import start_beside
from agentstream.demo.training import compute_dtype, fresh_database, new_run
from agentstream.deploy.deployments import DeploymentFollower, split_adapter_name
from agentstream.examples import arithmetic
from agentstream.infra.config import CHECKPOINT_BUCKET, Config, CreditRule
from agentstream.infra.processes import free_port
from agentstream.infra.security import FEEDBACK_TOKEN_HEADER
from agentstream.pipeline.proxy.feedback import feedback_url
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.pipeline.sdk import rollout, set_sink
from agentstream.session import SessionPlan, TrainingSession
from agentstream.stack.control import Stack
from agentstream.stack.machine import CpuShare, calibrate

SERVICE_AGENT = "arithmetic-service"
DATABASE = "agentstream_online"
MODEL = "SmolLM2-135M-Instruct"
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def checkpoint_location(config: Config, run_id: str, workdir: Path) -> str:
    """The run's checkpoints in the object store, as on several hosts; a local folder where there is none.

    There is one when ``[checkpoints] s3_endpoint`` names it, or the stack starts its embedded one
    (its own broker with durable storage).
    """
    embedded = not config.kafka.external and config.stack.broker_storage == "durable"
    if config.checkpoints.s3_endpoint or embedded:
        return f"s3://{CHECKPOINT_BUCKET}/online-{run_id}"
    return str(workdir / "checkpoints")


def online_config(config: Config, run_id: str, workdir: Path) -> Config:
    """The demo's settings: its own topics and database, the vLLM contract, LoRA, the gate, online credit."""
    demo = config.demo
    dtype = compute_dtype(config)  # bfloat16 on AMX: a LoRA step 4.4 s instead of 6.4 s here
    heldout = workdir / "heldout.jsonl"  # sampled as the service samples: greedy scores did not predict live ones
    heldout.write_text("\n".join(json.dumps({**task, "temperature": demo.online_temperature})
                                 for task in arithmetic.split()[1]))
    return replace(
        config,
        topics=replace(config.topics, prefix=f"online-{run_id}.", partitions=1),
        clickhouse=replace(config.clickhouse, database=DATABASE),
        streams=replace(config.streams, app_id=f"agentstream-online-{run_id}"),
        server=replace(config.server, contract="vllm", threads=demo.server_threads, dtype=dtype),
        credit=(CreditRule(agent=SERVICE_AGENT, strategy="baseline"), CreditRule(agent="*", train=False)),
        trainer=replace(config.trainer, model="smollm2", model_name=MODEL, threads=demo.trainer_threads, dtype=dtype,
                        lora=True, lora_target_modules=ALL_LINEAR, lr=demo.online_lr,
                        temperature=demo.online_temperature, batch_transitions=demo.online_batch, batch_tokens=0,
                        batch_wait_s=20.0,
                        max_policy_lag=demo.online_max_policy_lag,
                        checkpoint_every_steps=demo.online_steps_per_checkpoint, keep_checkpoints=0,
                        rebase_after_rejections=demo.online_rebase_after_rejections,
                        checkpoint_dir=checkpoint_location(config, run_id, workdir), session_timeout_s=6.0),
        deploy=replace(config.deploy, gate=True, eval_agent="agentstream.examples.arithmetic:solve",
                       eval_tasks=str(heldout),
                       eval_limit=demo.online_eval_tasks, eval_concurrency=16, tolerance=demo.online_tolerance,
                       confidence=demo.online_confidence, canary_share=demo.online_canary_share,
                       canary_min_s=demo.online_canary_s, canary_min_rollouts=12,
                       canary_max_s=10 * demo.online_canary_s),
    )


class ArithmeticService:
    """The production service: each ``POST /ask`` is one rollout whose LLM call goes through the proxy."""

    def __init__(self, proxy_url: str, proxy_key: str | None, model: str, temperature: float) -> None:
        self.proxy_url, self.proxy_key, self.model, self.temperature = proxy_url, proxy_key, model, temperature
        self.app = web.Application()
        self.app.router.add_post("/ask", self.ask)

    async def ask(self, request: web.Request) -> web.Response:
        question = str((await request.json())["question"])
        async with rollout(SERVICE_AGENT, proxy_url=self.proxy_url, proxy_key=self.proxy_key) as state:
            llm = arithmetic.client().with_options(base_url=state.llm_base_url(), api_key=state.llm_api_key())
            raw = await llm.chat.completions.with_raw_response.create(
                model=self.model, messages=[{"role": "user", "content": question}],
                max_tokens=arithmetic.MAX_TOKENS, temperature=self.temperature)
            completion = raw.parse()
        token = raw.headers.get(FEEDBACK_TOKEN_HEADER)  # lets this answer's user, and no one else, rate it
        return web.json_response({"answer": completion.choices[0].message.content or "", "model": completion.model,
                                  "rollout_id": state.rollout_id,
                                  "feedback_url": feedback_url(self.proxy_url, state.rollout_id, token)})


@dataclass
class Answer:
    """One user request as the user saw it."""

    at_s: float
    latency_s: float
    correct: bool | None = None
    version: int | None = None
    error: str | None = None


class Users:
    """Users asking at a steady rate (Poisson arrivals), checking each answer, and rating it later (or never)."""

    def __init__(self, service_url: str, tasks: list[dict], rate: float, max_delay_s: float, silent_share: float,
                 max_in_flight: int = 16, seed: int = 0) -> None:
        self.service_url, self.tasks, self.rate = service_url, tasks, rate
        self.max_delay_s, self.silent_share, self.max_in_flight = max_delay_s, silent_share, max_in_flight
        self.rng = random.Random(seed)
        self.answers: list[Answer] = []
        self.feedback_sent = self.feedback_withheld = self.feedback_failed = 0
        self.started = time.monotonic()
        self._asking: set[asyncio.Task] = set()
        self._feedback: set[asyncio.Task] = set()

    async def run(self, stop: asyncio.Event) -> None:
        self.started = time.monotonic()
        slots = asyncio.Semaphore(self.max_in_flight)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            while not stop.is_set():
                await slots.acquire()
                self._track(self._asking, self._ask(session, self.rng.choice(self.tasks), slots))
                await asyncio.sleep(self.rng.expovariate(self.rate))
            if self._asking:
                await asyncio.wait(self._asking)
            for waiting in self._feedback:  # the users still thinking about an answer leave with the demo
                waiting.cancel()
            await asyncio.gather(*self._feedback, return_exceptions=True)

    @staticmethod
    def _track(tasks: set[asyncio.Task], work) -> None:
        task = asyncio.create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _ask(self, session: aiohttp.ClientSession, task: dict, slots: asyncio.Semaphore) -> None:
        asked = time.monotonic()
        answer = Answer(at_s=asked - self.started, latency_s=0.0)
        try:
            async with session.post(f"{self.service_url}/ask", json={"question": task["prompt"]}) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {str(body)[:200]}")
            answer.latency_s = time.monotonic() - asked
            answer.correct = arithmetic.reward(body["answer"], int(task["answer"])) == 1.0
            answer.version = split_adapter_name(body["model"])[1] or 0
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError, KeyError) as error:
            answer.latency_s, answer.error = time.monotonic() - asked, repr(error)
        finally:
            slots.release()
        self.answers.append(answer)
        if answer.error is None:
            if self.rng.random() < self.silent_share:
                self.feedback_withheld += 1
            else:
                self._track(self._feedback, self._rate(session, body["feedback_url"], 1.0 if answer.correct else 0.0,
                                                       self.rng.uniform(1.0, self.max_delay_s)))

    async def _rate(self, session: aiohttp.ClientSession, url: str, reward: float, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        try:
            async with session.post(url, json={"reward": reward}) as response:
                response.raise_for_status()
            self.feedback_sent += 1
        except aiohttp.ClientError:
            self.feedback_failed += 1


@dataclass
class OnlineReport:
    """What ``online-report.json`` holds."""

    seconds: float
    traffic_seconds: float
    requests: int
    failed_requests: int
    success_first_2_min: float | None
    success_last_5_min: float | None
    per_minute: list[dict] = field(default_factory=list)
    per_version: list[dict] = field(default_factory=list)
    latency_ms: dict[str, float] = field(default_factory=dict)
    deployments: list[dict] = field(default_factory=list)
    promotions: int = 0
    rollbacks: int = 0
    rejections: int = 0
    feedback_sent: int = 0
    feedback_withheld: int = 0
    feedback_failed: int = 0  # refused by the reward endpoint or not delivered
    failures: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # what this run varied: rate, temperature, canary share, dtype, lr
    machine: dict = field(default_factory=dict)  # stack.machine.Calibration: compare runs on different machines
    cpu_share: dict[str, float] = field(default_factory=dict)  # each process's share of all cores while users asked


def success(answers: list[Answer]) -> float | None:
    judged = [bool(a.correct) for a in answers if a.error is None]
    return sum(judged) / len(judged) if judged else None


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


def build_report(users: Users, deployments: list[dict], traffic_seconds: float, seconds: float) -> OnlineReport:
    answers = users.answers
    minutes: dict[int, list[Answer]] = {}
    versions: dict[int, list[Answer]] = {}
    for answer in answers:
        minutes.setdefault(int(answer.at_s // 60), []).append(answer)
        if answer.error is None and answer.version is not None:
            versions.setdefault(answer.version, []).append(answer)
    latencies = [a.latency_s for a in answers if a.error is None]
    actions = [row["action"] for row in deployments]
    return OnlineReport(
        seconds=round(seconds, 1), traffic_seconds=round(traffic_seconds, 1), requests=len(answers),
        failed_requests=sum(a.error is not None for a in answers),
        success_first_2_min=success([a for a in answers if a.at_s < 120]),
        success_last_5_min=success([a for a in answers if a.at_s >= traffic_seconds - 300]),
        per_minute=[{"minute": m, "requests": len(group), "success": success(group),
                     "versions": sorted({a.version for a in group if a.version is not None})}
                    for m, group in sorted(minutes.items())],
        per_version=[{"version": v, "requests": len(group), "success": success(group)}
                     for v, group in sorted(versions.items())],
        latency_ms={"p50": percentile_ms(latencies, 0.5), "p95": percentile_ms(latencies, 0.95),
                    "p99": percentile_ms(latencies, 0.99)},
        deployments=deployments, promotions=actions.count("PROMOTED"), rollbacks=actions.count("ROLLED_BACK"),
        rejections=actions.count("REJECTED"), feedback_sent=users.feedback_sent,
        feedback_withheld=users.feedback_withheld, feedback_failed=users.feedback_failed,
        failures=[a.error for a in answers if a.error][:10])


def settings(config: Config) -> dict:
    """The settings a reader compares two runs by (``config`` as ``online_config`` made it)."""
    trainer = config.trainer
    return {"rate_per_s": config.demo.online_rate, "temperature": trainer.temperature, "lr": trainer.lr,
            "batch": trainer.batch_transitions, "kl_coef": trainer.kl_coef,
            "rebase_after_rejections": trainer.rebase_after_rejections, "canary_share": config.deploy.canary_share,
            "gate_tolerance": config.deploy.tolerance, "gate_confidence": config.deploy.confidence,
            "dtype": trainer.dtype, "model_servers": config.demo.online_model_servers,
            "checkpoints": trainer.checkpoint_dir}


def decisions(client) -> list[dict]:
    rows = client.query("SELECT toString(decided_at), version, action, decided_by, candidate_score, stable_score, "
                        "canary_reward, stable_reward, reason FROM deployments FINAL ORDER BY decided_at").result_rows
    names = ("decided_at", "version", "action", "decided_by", "candidate_score", "stable_score", "canary_reward",
             "stable_reward", "reason")
    return [dict(zip(names, row, strict=True)) for row in rows]


def write_plot(path: Path, report: OnlineReport) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    minutes = [row["minute"] + 0.5 for row in report.per_minute if row["success"] is not None]
    axis.plot(minutes, [row["success"] for row in report.per_minute if row["success"] is not None], marker="o",
              label="live success rate (per minute)")
    axis.axhline(0.75, color="grey", linestyle=":", label="75%")
    axis.set_xlabel("minute of traffic")
    axis.set_ylabel("share of correct answers")
    axis.set_ylim(0, 1.02)
    served = ", ".join(f"v{row['version']}: {row['success']:.0%} of {row['requests']}" for row in report.per_version
                       if row["success"] is not None)
    axis.set_title(f"{SERVICE_AGENT} learning from its users' feedback\n{served}"[:160], fontsize=9)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_report(console: Console, report: OnlineReport) -> None:
    table = Table(title="live success per minute")
    for column in ("minute", "requests", "success", "served by"):
        table.add_column(column)
    for row in report.per_minute:
        rate = "-" if row["success"] is None else f"{row['success']:.0%}"
        table.add_row(str(row["minute"]), str(row["requests"]), rate, " ".join(f"v{v}" for v in row["versions"]))
    console.print(table)
    decided = Table(title="deployment decisions")
    for column in ("at", "version", "action", "by", "reason"):
        decided.add_column(column)
    for row in report.deployments:
        decided.add_row(row["decided_at"][11:19], str(row["version"]), row["action"], row["decided_by"],
                        row["reason"][:90])
    console.print(decided)
    first = "-" if report.success_first_2_min is None else f"{report.success_first_2_min:.0%}"
    last = "-" if report.success_last_5_min is None else f"{report.success_last_5_min:.0%}"
    console.print(f"live success {first} (first 2 min) -> {last} (last 5 min); {report.requests} requests, "
                  f"{report.failed_requests} failed; latency p50 {report.latency_ms['p50']:.0f} ms, "
                  f"p95 {report.latency_ms['p95']:.0f} ms, p99 {report.latency_ms['p99']:.0f} ms; "
                  f"{report.promotions} promotions, {report.rollbacks} rollbacks, {report.rejections} rejections")
    if report.cpu_share:
        console.print(f"CPU while users asked, share of all cores: {sum(report.cpu_share.values()):.2f} ("
                      + ", ".join(f"{label} {share:.2f}" for label, share in report.cpu_share.items() if share >= 0.01)
                      + ")")


async def serve_traffic(session: TrainingSession, config: Config, endpoints, console: Console,
                        workdir: Path) -> tuple[Users, float]:
    """Run the service and its users for ``demo.online_seconds``, printing progress."""
    demo = config.demo
    publisher = SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=workdir / "journal").start()
    set_sink(publisher)
    service = web.AppRunner(ArithmeticService(session.proxy_url, session.proxy_key, MODEL,
                                              demo.online_temperature).app, access_log=None)
    await service.setup()
    port = free_port()
    await web.TCPSite(service, "127.0.0.1", port).start()
    service_url = f"http://127.0.0.1:{port}"
    follower = DeploymentFollower(config, endpoints.bootstrap_servers)
    stop, traffic_stop = asyncio.Event(), asyncio.Event()
    following = asyncio.create_task(follower.run(stop))
    users = Users(service_url, arithmetic.split()[0], demo.online_rate, demo.online_feedback_max_delay_s,
                  demo.online_silent_share)
    console.print(f"service       {service_url}/ask ({SERVICE_AGENT}); users ask {demo.online_rate}/s, feedback "
                  f"after 1-{demo.online_feedback_max_delay_s:.0f} s, {demo.online_silent_share:.0%} never")
    traffic = asyncio.create_task(users.run(traffic_stop))
    started = time.monotonic()
    try:
        while time.monotonic() - started < demo.online_seconds:
            session.check()
            await asyncio.sleep(15.0)
            elapsed = time.monotonic() - started
            recent = [a for a in users.answers if a.at_s >= elapsed - 60]
            rate = success(recent)
            routing = follower.routing(MODEL)
            console.print(f"[{elapsed:5.0f}s] {len(users.answers)} requests "
                          f"({sum(a.error is not None for a in users.answers)} failed), last minute "
                          f"{'-' if rate is None else f'{rate:.0%}'} correct; serving "
                          f"{routing.describe() if routing else 'the base model (no decision yet)'}")
    finally:
        traffic_stop.set()
        await traffic
        stop.set()
        await following
        await service.cleanup()
        set_sink(None)
        await asyncio.to_thread(publisher.close)
    return users, time.monotonic() - started


def run_online_demo(config: Config, console: Console | None = None) -> OnlineReport:
    """The whole online demo; returns (and writes) its report."""
    console = console or product_console()
    started = time.monotonic()
    run_id, workdir = new_run(config, "online")
    config = online_config(config, run_id, workdir)
    demo = config.demo
    console.rule(f"agentstream online demo ({demo.online_seconds:.0f} s of live traffic, vLLM contract, gated, "
                 f"{config.trainer.dtype})")
    machine = calibrate()
    console.print(f"machine: {machine.describe()} (docs/online.md's figures name theirs)")
    console.print(f"checkpoints   {config.trainer.checkpoint_dir}, served by {demo.online_model_servers} model "
                  "server(s) behind the proxy")
    stack = Stack(config)
    endpoints = stack.up(progress=console.print)
    session = TrainingSession(config, endpoints, workdir, SessionPlan(
        agent="agentstream.examples.arithmetic:solve", model="smollm2", server_threads=demo.server_threads,
        servers=demo.online_model_servers))
    live_dashboard = start_beside(config, endpoints, console.print)  # up while the demo runs
    try:
        client = fresh_database(config, endpoints.clickhouse_url, console)
        session.start(progress=console.print)
        with CpuShare("agentstream demo", machine.cores) as cpu:
            users, traffic_seconds = asyncio.run(serve_traffic(session, config, endpoints, console, workdir))
        report = replace(build_report(users, decisions(client), traffic_seconds, time.monotonic() - started),
                         settings=settings(config), machine=machine.as_dict(), cpu_share=cpu.shares())
    finally:
        if live_dashboard is not None:
            live_dashboard.stop()
        session.stop()
        stack.down(progress=console.print)
    output = Path(demo.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    Path(demo.online_report_path).write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    write_plot(output / "online.png", report)
    print_report(console, report)
    console.print(f"wrote {demo.online_report_path} and {output / 'online.png'}; logs in {workdir}")
    return report
