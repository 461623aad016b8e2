"""Trainer figures on a private stack, with the tiny model on CPU. Prints one JSON line per figure.

- trainer_tokens_per_s: the trainer worker fed from Kafka (transitions topic → decode → batch →
  step → train_steps row), tokens trained per second from its first record to its last step;
  ``peer`` is the same steps fed from memory (same transitions, batcher, step and model) and
  ``ratio`` = Kafka / memory (target ≥ 0.9). Runs alternate, several rounds; the figures are
  medians and the ratio is the median of each round's pair.
  ``*_time_in_steps`` is the share of that time spent inside optimizer steps: what the feed
  costs, unaffected by how fast other load on the machine lets the steps themselves run.
- hot_swap_seconds: Checkpoint event published → first span carrying the new version on the spans
  topic, with `serve-model`, `proxy` and `hotswap` as their own processes and requests flowing
  through the proxy all along (median of several swaps; target ≤ 5 s).
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as `python bench/trainer.py`: this file must not shadow the trainer package

import asyncio
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from agentstream.infra.clickhouse import connect, migrate
from agentstream.infra.config import Config, TrainerConfig, load_config
from agentstream.infra.kafka import client_options, create_topics, topic_name
from agentstream.infra.processes import free_port
from agentstream.schemas import TRANSITION, AvroCodec
from agentstream.stack.control import Stack
from agentstream.trainer.batching import Batcher, Sample, SeenIds
from agentstream.trainer.checkpoint_writer import CheckpointAnnouncer, open_store, write_checkpoint
from agentstream.trainer.metrics import MetricsWriter
from agentstream.trainer.policy import build_policy, save_weights
from agentstream.trainer.step import train_step
from agentstream.trainer.worker import TrainerWorker
from bench.common import private_environ

BENCH = "trainer"
TRANSITIONS = 768
PROMPT_TOKENS, RESPONSE_TOKENS = 96, 64
SWAPS = 5
ROUNDS = 5


def emit(metric: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": round(value, 3), "unit": unit, **extra}), flush=True)


def transitions(model: str, count: int) -> list[dict]:
    """Transitions of the tiny model's byte vocabulary with plausible logprobs and GRPO-like advantages."""
    rng = random.Random(3)
    return [{"transition_id": f"t{i:06d}", "rollout_id": f"r{i}", "span_id": f"s{i}", "agent_name": "bench",
             "model": model, "policy_version": 0, "step_index": 0,
             "prompt_token_ids": [rng.randrange(3, 259) for _ in range(PROMPT_TOKENS)],
             "response_token_ids": [rng.randrange(3, 259) for _ in range(RESPONSE_TOKENS)],
             "behaviour_logprobs": [-rng.uniform(4.0, 7.0) for _ in range(RESPONSE_TOKENS)],
             "reward": rng.random(), "return_value": 0.0, "advantage": rng.gauss(0, 1), "group_id": None,
             "created_at_us": time.time_ns() // 1000} for i in range(count)]


async def from_memory(settings: TrainerConfig, records: list[dict]) -> tuple[float, float]:
    """Tokens per second of the same batcher and steps (off the event loop, as in the worker), fed from memory,
    and the fraction of the time spent inside steps."""
    policy = build_policy(settings)
    batcher = Batcher(batch_tokens=settings.batch_tokens, batch_transitions=settings.batch_transitions,
                      batch_wait_s=0, max_policy_lag=settings.max_policy_lag, skip_zero_advantage=True,
                      seen=SeenIds(settings.dedupe_window))
    model_thread = ThreadPoolExecutor(max_workers=1)
    tokens, stepping, started = 0, 0.0, time.perf_counter()
    for record in records:
        batcher.offer(Sample.from_record(record), 0, time.monotonic())
        while batcher.ready(time.monotonic()):
            result = await asyncio.get_running_loop().run_in_executor(
                model_thread, train_step, policy, batcher.take(0), settings)
            tokens, stepping = tokens + result.tokens, stepping + result.seconds
    wall = time.perf_counter() - started
    model_thread.shutdown()
    return tokens / wall, stepping / wall


async def from_kafka(config: Config, bootstrap: str, metrics: MetricsWriter,
                     records: list[dict]) -> tuple[float, float]:
    """Tokens per second of the trainer worker reading the same transitions from the topic, and its time in steps."""
    await create_topics(config, bootstrap)
    codec = AvroCodec()
    producer = AIOKafkaProducer(**client_options(config.kafka, bootstrap), acks="all", linger_ms=5)
    await producer.start()
    for record in records:
        await producer.send(topic_name(config.topics, "transitions"), key=record["model"].encode(),
                            value=codec.encode(TRANSITION, record))
    await producer.stop()
    worker = TrainerWorker(config, bootstrap, metrics=metrics, progress=lambda line: None)
    steps = len(records) // config.trainer.batch_transitions
    summary = await worker.run(max_steps=steps)
    wall = summary.last_step_at - summary.first_record_at
    return summary.tokens / wall, summary.train_seconds / wall


class Process:
    """An `agentstream` command as its own process."""

    def __init__(self, args: list[str], env: dict, log: Path) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([sys.executable, "-m", "agentstream", *args], env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


async def hot_swaps(config: Config, bootstrap: str, env: dict, home: Path) -> list[float]:
    """Seconds from each Checkpoint event to the first span with its version, while requests keep flowing."""
    await create_topics(config, bootstrap)
    server_port, proxy_port = free_port(), free_port()
    server, proxy = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{proxy_port}"
    processes = [Process(["serve-model", "--model", "tiny", "--port", str(server_port)], env, home / "server.log"),
                 Process(["proxy", "--upstream", server, "--port", str(proxy_port)], env, home / "proxy.log"),
                 Process(["hotswap", "--server", server, "--model", "tiny"], env, home / "hotswap.log")]
    codec = AvroCodec()
    spans = AIOKafkaConsumer(topic_name(config.topics, "spans"), **client_options(config.kafka, bootstrap),
                             auto_offset_reset="latest", fetch_max_wait_ms=20)
    announcer = CheckpointAnnouncer(config, bootstrap)
    store = open_store(str(home / "swap-checkpoints"))
    settings = replace(config.trainer, model_name="tiny")
    policy = build_policy(settings)
    stop = asyncio.Event()

    async def load(session: aiohttp.ClientSession) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        while not stop.is_set():
            try:
                async with session.post(f"{proxy}/rollouts/bench-{time.time_ns()}/v1/chat/completions",
                                        json=body) as response:
                    await response.read()
            except aiohttp.ClientError:
                await asyncio.sleep(0.2)  # the proxy or server is still starting

    async def first_span_with(version: int) -> float:
        while True:
            for records in (await spans.getmany(timeout_ms=100)).values():
                for record in records:
                    name, value = codec.decode(record.value)
                    batch = value["spans"] if name.endswith("SpanBatch") else [value]
                    if any(span.get("policy_version") == version for span in batch):
                        return time.time()

    await spans.start()
    await announcer.start()
    seconds = []
    try:
        async with aiohttp.ClientSession() as session:
            clients = [asyncio.create_task(load(session)) for _ in range(2)]
            await asyncio.wait_for(first_span_with(0), 120)  # everything is up and spans flow
            for version in range(1, SWAPS + 1):
                staging = store.staging()
                manifest = write_checkpoint(store, staging, save_weights(policy, staging), model="tiny",
                                            version=version, step=version, format="full", offsets={},
                                            trained_ids=[], metrics={})
                published = time.time()
                await announcer.announce(manifest)
                seconds.append(await asyncio.wait_for(first_span_with(version), 60) - published)
            stop.set()
            await asyncio.gather(*clients)
    finally:
        await announcer.stop()
        await spans.stop()
        for process in processes:
            process.stop()
    return seconds


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="agentstream-bench-") as folder:
        home = Path(folder)
        environ = private_environ(str(home), AGENTSTREAM_TOPIC_PARTITIONS="1")
        config = load_config(environ=environ)
        # One torch thread: the tiny model is Python-bound (two threads are no faster), and one thread is far less
        # disturbed by other load on a 2-core machine, which otherwise swamps the comparison.
        settings = TrainerConfig(model="tiny", model_name="tiny", device="cpu", threads=1, lr=1e-4,
                                 batch_transitions=32, batch_tokens=0, batch_wait_s=5, max_policy_lag=1000,
                                 checkpoint_every_steps=10_000, checkpoint_dir=str(home / "checkpoints"),
                                 session_timeout_s=3)
        config = replace(config, trainer=settings)
        stack = Stack(config)
        endpoints = stack.up(progress=lambda line: None)
        try:
            client = connect(config.clickhouse, endpoints.clickhouse_url)
            migrate(client, config.clickhouse.database)
            metrics = MetricsWriter(client, config.clickhouse.database)
            records = transitions("tiny", TRANSITIONS)
            asyncio.run(from_memory(settings, records[:64]))  # warm-up: first-step allocations, thread pools
            memory, kafka = [], []
            for round_ in range(ROUNDS):  # interleaved and paired: load from other processes drifts between rounds
                memory.append(asyncio.run(from_memory(settings, records)))
                fresh = replace(config, topics=replace(config.topics, prefix=f"bench{round_}."),
                                trainer=replace(settings, checkpoint_dir=str(home / f"checkpoints{round_}")))
                kafka.append(asyncio.run(from_kafka(fresh, endpoints.bootstrap_servers, metrics, records)))
            ratios = [k[0] / m[0] for k, m in zip(kafka, memory, strict=True)]
            emit("trainer_tokens_per_s", statistics.median(k[0] for k in kafka), "tokens/s",
                 peer=round(statistics.median(m[0] for m in memory), 1), ratio=round(statistics.median(ratios), 3),
                 kafka_runs=[round(k[0]) for k in kafka], memory_runs=[round(m[0]) for m in memory],
                 kafka_time_in_steps=round(statistics.median(k[1] for k in kafka), 3),
                 memory_time_in_steps=round(statistics.median(m[1] for m in memory), 3), model="tiny",
                 transitions=TRANSITIONS,
                 tokens_per_transition=PROMPT_TOKENS + RESPONSE_TOKENS, batch_transitions=settings.batch_transitions)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
            env.update(environ, KAFKA_BOOTSTRAP_SERVERS=endpoints.bootstrap_servers,
                       CLICKHOUSE_URL=endpoints.clickhouse_url)
            seconds = asyncio.run(hot_swaps(config, endpoints.bootstrap_servers, env, home))
            emit("hot_swap_seconds", statistics.median(seconds), "s", max=round(max(seconds), 3), swaps=len(seconds),
                 model="tiny")
            client.close()
        finally:
            stack.down(progress=lambda line: None)


if __name__ == "__main__":
    main()
