"""A fleet on one machine: one against two model servers behind the proxy, one against two stream workers, and
the two-rank trainer's step against one rank's, each as a ratio.

Every process is the real one, started through the CLI over a private stack:
- proxy: `agentstream proxy` in front of one `agentstream serve-model` (tiny model), then of two,
  ``--concurrency`` clients in this process sending the same mix of chat completions (greedy
  answers of 8, 16 or 32 tokens, the end-of-sequence token ignored) for ``--seconds``; completed
  requests and generated tokens per second, and two servers' over one's;
- streams: one `agentstream streams` worker, then two in the same consumer group (the spans
  topic has ``[topics] partitions``, 4), each time once the group has settled; ``--rollouts``
  rollouts of 15 LLM spans and a reward published at full speed until every span and every
  transition is in ClickHouse; spans and rollouts per second, and two workers' over one's;
- trainer: bench.distributed_trainer's measurement (tiny model, its defaults): one rank's step
  at one and at two threads, two gloo ranks' step at one thread each, and the ratios.
One and two alternate ``--rounds`` times and each side's counts and seconds are summed. Each
line names the processes' CPU seconds, how busy the whole machine was (``machine_busy``: 1.0 is
every core; the rest of it was other users) and its load average, after the machine's
calibration line. Everything shares this machine's cores: on a machine with few of them a
second server or worker competes with the first, and the ratios say what that gives here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from agentstream.infra.clickhouse import connect
from agentstream.infra.config import Config
from agentstream.infra.kafka import topic_name
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.session import Child
from agentstream.stack.control import Endpoints
from agentstream.stack.machine import CpuShare, calibrate
from bench import distributed_trainer
from bench.common import cli_environ, emit, private_stack
from bench.streams import SPANS_PER_ROLLOUT, Workload

BENCH = "fleet"
ANSWER_TOKENS = (8, 16, 32)
"""The request mix's max_tokens, in turn; with ignore_eos every answer is that long."""


def ratio(two: float, one: float) -> float | None:
    """Two's figure over one's; None where one measured nothing."""
    return two / one if one > 0 else None


def busy_jiffies() -> tuple[int, int]:
    """The machine's busy and total CPU time so far, in clock ticks over all cores (/proc/stat's first line)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    total = sum(fields[:8])  # guest time is already inside user time
    return total - idle, total


@dataclass
class Tally:
    """What one side (one or two servers or workers) did over its rounds, and what the machine did meanwhile."""

    count: int = 0
    tokens: int = 0
    errors: int = 0
    seconds: float = 0.0
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    watched_s: float = 0.0
    busy: int = 0
    jiffies: int = 0
    load: list[float] = field(default_factory=list)
    cores: int = 1

    @contextlib.contextmanager
    def watching(self, cores: int, label: str) -> Iterator[None]:
        """Add this block's CPU seconds per process (this one named ``label``), the machine's busy time and its load
        average to the tally."""
        busy, total = busy_jiffies()
        began = time.monotonic()
        with CpuShare(label, cores) as meter:
            yield
        self.watched_s += time.monotonic() - began
        self.cores = cores
        for name, seconds in meter.seconds_by_label().items():
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + seconds
        busy_after, total_after = busy_jiffies()
        self.busy += busy_after - busy
        self.jiffies += total_after - total
        self.load.append(os.getloadavg()[0])

    def machine(self) -> dict[str, Any]:
        """The JSON fields every figure carries about the machine while it was measured: CPU seconds per process of
        ours over ``watched_s`` (warm-ups included), their share of all cores, and the whole machine's."""
        ours = sum(self.cpu_seconds.values()) / max(self.watched_s * self.cores, 1e-9)
        return {"cpu_seconds": {label: round(seconds, 1) for label, seconds in sorted(self.cpu_seconds.items())
                                if seconds >= 0.05},
                "watched_s": round(self.watched_s, 1), "our_share": round(ours, 3),
                "machine_busy": round(self.busy / max(self.jiffies, 1), 3),
                "load_avg_1m": [round(load, 2) for load in self.load]}


# ---------------------------------------------------------------- proxy: one and two model servers


def request_body(index: int) -> dict[str, Any]:
    """The index-th request of the mix: the same for every side, so each sees the same work."""
    rng = random.Random(index)
    return {"model": "tiny", "messages": [{"role": "user", "content": f"Compute {rng.randint(1, 99)}+"
                                                                      f"{rng.randint(1, 99)}."}],
            "max_tokens": ANSWER_TOKENS[index % len(ANSWER_TOKENS)], "temperature": 0, "ignore_eos": True}


async def drive(proxy_url: str, concurrency: int, seconds: float, warmup_s: float, tally: Tally) -> None:
    """``concurrency`` clients call the proxy back to back; the calls that end within the ``seconds`` after
    ``warmup_s`` are counted. Nobody starts a call after the window, so the next side begins on idle servers."""
    began = time.monotonic()
    opens, closes = began + warmup_s, began + warmup_s + seconds
    issued = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal issued
        while time.monotonic() < closes:
            index, issued = issued, issued + 1
            url = f"{proxy_url}/rollouts/fleet-{index}/v1/chat/completions"
            async with session.post(url, json=request_body(index)) as response:
                answer = await response.json() if response.status == 200 else None
            if opens <= time.monotonic() <= closes:
                if answer is None:
                    tally.errors += 1
                else:
                    tally.count += 1
                    tally.tokens += answer["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    tally.seconds += seconds


def wait_healthy(child: Child, url: str, timeout_s: float = 120.0) -> None:
    """Block until ``url``/health answers 200, or raise with the process's log."""
    async def poll() -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                child.check()
                try:
                    async with session.get(f"{url}/health") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} did not answer in {timeout_s:.0f} s:\n{child.log_tail()}")
                await asyncio.sleep(0.1)

    asyncio.run(poll())


def start_server(env: dict[str, str], home: Path, threads: int) -> tuple[Child, str]:
    port = free_port()
    server = Child("serve-model", ["serve-model", "--model", "tiny", "--served-model-name", "tiny", "--port", str(port),
                                   "--threads", str(threads)], env, home / f"serve-model-{port}.log").start()
    return server, f"http://127.0.0.1:{port}"


def start_proxy(env: dict[str, str], home: Path, upstreams: list[str]) -> tuple[Child, str]:
    port = free_port()
    options = [option for url in upstreams for option in ("--upstream", url)]
    proxy = Child("proxy", ["proxy", *options, "--port", str(port), "--no-deployments"], env,
                  home / f"proxy-{port}.log").start()
    assert proxy.process is not None
    wait_for_port("127.0.0.1", port, 60, proxy.process, proxy.log_path)
    return proxy, f"http://127.0.0.1:{port}"


def proxy_part(args: argparse.Namespace, endpoints: Endpoints, home: Path, cores: int) -> None:
    """Two model servers; one proxy in front of the first, another in front of both; the two sides alternate."""
    env = cli_environ(endpoints, str(home))
    children: list[Child] = []
    try:
        servers = [start_server(env, home, args.server_threads) for _ in range(2)]
        children += [child for child, _ in servers]
        for child, url in servers:
            wait_healthy(child, url)
        urls = [url for _, url in servers]
        proxies = {count: start_proxy(env, home, urls[:count]) for count in (1, 2)}
        children += [child for child, _ in proxies.values()]
        tallies = {1: Tally(), 2: Tally()}
        for _ in range(args.rounds):
            for count, (_, url) in proxies.items():
                with tallies[count].watching(cores, "bench (clients)"):
                    asyncio.run(drive(url, args.concurrency, args.seconds, args.warmup, tallies[count]))
    finally:
        for child in children:
            child.stop()
    shape = {"concurrency": args.concurrency, "answer_tokens": list(ANSWER_TOKENS), "model": "tiny",
             "server_threads": args.server_threads, "rounds": args.rounds}
    for count, tally in tallies.items():
        emit(BENCH, "proxy_requests_per_s", tally.count / tally.seconds, "requests/s", servers=count,
             requests=tally.count, tokens=tally.tokens, errors=tally.errors, seconds=round(tally.seconds, 2),
             tokens_per_s=round(tally.tokens / tally.seconds, 1), **shape, **tally.machine())
    one, two = (tallies[count].count / tallies[count].seconds for count in (1, 2))
    emit(BENCH, "proxy_two_servers_over_one", ratio(two, one), "ratio", one_requests_per_s=round(one, 1),
         two_requests_per_s=round(two, 1), **shape)


# ---------------------------------------------------------------- streams: one and two workers


def assigned(worker: Child, topic: str) -> list[int]:
    """The spans partitions a worker says it was last given (its log's last assignment line)."""
    marker = f"assigned {topic} partitions "
    lines = [line for line in worker.log_tail(200_000).splitlines() if marker in line]
    return [int(p) for p in re.findall(r"\d+", lines[-1].split(marker, 1)[1].split("]", 1)[0])] if lines else []


def settle(workers: list[Child], topic: str, partitions: int, timeout_s: float = 120.0) -> None:
    """Block until the running workers hold every partition between them, each some and none twice."""
    deadline = time.monotonic() + timeout_s
    while True:
        for worker in workers:
            worker.check()
        held = [assigned(worker, topic) for worker in workers]
        if all(held) and sorted(p for mine in held for p in mine) == list(range(partitions)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the group did not settle in {timeout_s:.0f} s: {held}")
        time.sleep(0.2)


def start_worker(env: dict[str, str], home: Path, index: int) -> Child:
    worker = Child(f"streams worker {index}", ["streams"], env, home / f"streams-{index}.log").start()
    deadline = time.monotonic() + 120
    while b"Worker]: Ready" not in worker.log_path.read_bytes():
        worker.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{worker.name} did not start:\n{worker.log_tail()}")
        time.sleep(0.2)
    return worker


def counts(client: Any) -> tuple[int, int]:
    """Spans and transitions in ClickHouse now, each counted once (a rebalance may have a row inserted twice, and
    a merge then removes the second: a plain count can fall)."""
    spans = client.query("SELECT uniqExact(span_id) FROM spans").result_rows[0][0]
    transitions = client.query("SELECT uniqExact(transition_id) FROM transitions").result_rows[0][0]
    return spans, transitions


def ingest(publisher: SpanPublisher, workload: Workload, client: Any, rollouts: int, timeout_s: float = 120) -> float:
    """Publish ``rollouts`` rollouts at full speed; the seconds until all their spans and transitions are rows."""
    spans, transitions = counts(client)
    want = (spans + rollouts * SPANS_PER_ROLLOUT, transitions + rollouts * (SPANS_PER_ROLLOUT - 1))
    started = time.perf_counter()
    for _ in range(rollouts):
        workload.rollout(publisher)
    publisher.flush(120)
    while any(have < wanted for have, wanted in zip(counts(client), want, strict=True)):
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"ClickHouse has {counts(client)} of {want} spans and transitions after "
                               f"{timeout_s:.0f} s (--logs DIR keeps the workers' logs)")
        time.sleep(0.1)
    return time.perf_counter() - started


def streams_part(args: argparse.Namespace, config: Config, endpoints: Endpoints, home: Path, cores: int) -> None:
    """The first worker stays; the second joins for the two-worker side and leaves after it; each side starts on a
    settled group with a warm-up batch."""
    env = cli_environ(endpoints, str(home))
    topic, partitions = topic_name(config.topics, "spans"), config.topics.partitions
    client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database)
    workload = Workload()
    tallies = {1: Tally(), 2: Tally()}
    workers = [start_worker(env, home, 0)]
    try:
        with SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=home / "journal") as publisher:
            for round_ in range(args.rounds):
                for count in (1, 2):
                    if count == 1 and len(workers) == 2:
                        workers.pop().stop()
                    if count == 2:
                        workers.append(start_worker(env, home, round_ + 1))
                    settle(workers, topic, partitions)
                    ingest(publisher, workload, client, args.warmup_rollouts)
                    with tallies[count].watching(cores, "bench (publisher)"):
                        tallies[count].seconds += ingest(publisher, workload, client, args.rollouts)
                    tallies[count].count += args.rollouts
    finally:
        for worker in workers:
            worker.stop()
        client.close()
    shape = {"spans_per_rollout": SPANS_PER_ROLLOUT, "span_bytes": 1000, "partitions": partitions,
             "level": "transition", "rounds": args.rounds}
    for count, tally in tallies.items():
        emit(BENCH, "streams_spans_per_s", tally.count * SPANS_PER_ROLLOUT / tally.seconds, "spans/s",
             workers=count, rollouts=tally.count, spans=tally.count * SPANS_PER_ROLLOUT,
             seconds=round(tally.seconds, 2), rollouts_per_s=round(tally.count / tally.seconds, 1), **shape,
             **tally.machine())
    one, two = (tallies[count].count / tallies[count].seconds for count in (1, 2))
    emit(BENCH, "streams_two_workers_over_one", ratio(two, one), "ratio", one_rollouts_per_s=round(one, 1),
         two_rollouts_per_s=round(two, 1), **shape)


# ---------------------------------------------------------------- trainer: two ranks and one


def trainer_part(args: argparse.Namespace, cores: int) -> None:
    """bench.distributed_trainer's measurement at its defaults, ``--trainer-rounds`` steps each."""
    settings = distributed_trainer.arguments(["--rounds", str(args.trainer_rounds)])
    shape = distributed_trainer.shape_of(settings)
    tally = Tally()
    with tally.watching(cores, "bench (one rank)"):
        measured = distributed_trainer.measure(settings)
    tally.cpu_seconds["two ranks"] = tally.cpu_seconds.pop("python", 0.0)  # spawned: no label of their own
    steps = {"steps": settings.rounds, **shape}
    emit(BENCH, "trainer_step_seconds_one_rank", measured.one, "s", threads=settings.threads, **steps)
    emit(BENCH, "trainer_step_seconds_one_rank", measured.one_doubled, "s", threads=2 * settings.threads, **steps)
    emit(BENCH, "trainer_step_seconds_two_ranks", measured.two_step, "s", threads_per_rank=settings.threads,
         each=[round(s, 3) for s in measured.two["step"]], **steps, **tally.machine())
    for one, threads in ((measured.one, settings.threads), (measured.one_doubled, 2 * settings.threads)):
        emit(BENCH, "trainer_two_ranks_step_over_one_rank", ratio(measured.two_step, one), "ratio",
             one_rank_threads=threads, threads_per_rank=settings.threads,
             note="step time: below 1 is a speed-up", **steps)


PARTS = ("streams", "proxy", "trainer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="One short round of each (about two minutes).")
    parser.add_argument("--only", choices=PARTS, action="append", help="Measure only this part (repeatable).")
    parser.add_argument("--rounds", type=int, default=2, help="Times one and two alternate, for proxy and streams.")
    parser.add_argument("--seconds", type=float, default=15.0, help="Proxy: seconds counted per side and round.")
    parser.add_argument("--warmup", type=float, default=2.0, help="Proxy: seconds of calls before counting.")
    parser.add_argument("--concurrency", type=int, default=8, help="Proxy: clients calling at once.")
    parser.add_argument("--server-threads", type=int, default=1, help="Proxy: torch threads of each model server.")
    parser.add_argument("--rollouts", type=int, default=4000, help="Streams: rollouts of 16 spans per side and round.")
    parser.add_argument("--warmup-rollouts", type=int, default=200, help="Streams: rollouts before each side counts.")
    parser.add_argument("--trainer-rounds", type=int, default=5, help="Trainer: steps measured per configuration.")
    parser.add_argument("--logs", type=Path, help="Keep the processes' logs in this folder (default: removed).")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.rollouts, args.trainer_rounds = 1, 5.0, 500, 3
    parts = args.only or PARTS

    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict(),
         load_avg_1m=round(os.getloadavg()[0], 2))
    if "streams" in parts or "proxy" in parts:
        # streams first: the proxy's spans then wait in the topic with no worker to read them
        logs = contextlib.nullcontext(str(args.logs)) if args.logs else tempfile.TemporaryDirectory(prefix="fleet-")
        with private_stack() as (config, endpoints), logs as scratch:
            Path(scratch).mkdir(parents=True, exist_ok=True)
            if "streams" in parts:
                streams_part(args, config, endpoints, Path(scratch), calibration.cores)
            if "proxy" in parts:
                proxy_part(args, endpoints, Path(scratch), calibration.cores)
    if "trainer" in parts:
        trainer_part(args, calibration.cores)


if __name__ == "__main__":
    main()
