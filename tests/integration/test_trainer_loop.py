"""The whole loop learns: runner -> proxy -> dev server -> spans -> streams -> transitions -> trainer -> hot swap.

Every component is a real `agentstream` process on the real broker and ClickHouse. The agent
asks a random-init tiny model (through the OpenAI SDK and the proxy) to write letters; its
reward is the fraction of the 12 sampled tokens that came out as ASCII letters (about 0.15 at
the start). Streams assigns GRPO credit over groups of 8 rollouts of a task, the trainer steps
on the exact token ids, and every checkpoint is hot-swapped into the dev server while the
runner keeps generating, so later rollouts come from newer policy versions.
"""

from __future__ import annotations

import asyncio
import statistics
import string
import time
import uuid

from agentstream.infra.config import load_config
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.pipeline.runner.tasks import enqueue, grouped_tasks
from tests.support.streams_harness import CliProcess, Worker, create_topics, worker_env

MAX_TOKENS = 12
GROUP_SIZE = 8
MAX_STEPS = 40
GOOD_ENOUGH = 0.6  # stop early once the last 3 steps' mean reward reaches this
STALL_S = 90
CAP_S = 600
CONFIG = """
[topics]
partitions = 1  # tasks are taken in order, so the 8 rollouts of a group run together

[streams]
app_id = "streams-{tag}"
grace_s = 0.2
session_timeout_s = 3

[[credit]]
agent = "*"
strategy = "grpo"
group_size = {group_size}
group_timeout_s = 20

[trainer]
model = "tiny"
device = "cpu"
threads = 1
lr = 0.003
batch_transitions = 32
batch_tokens = 0
batch_wait_s = 20
max_policy_lag = 3
checkpoint_every_steps = 1
checkpoint_dir = "{checkpoints}"
session_timeout_s = 3
"""


def letters_reward(text: str) -> float:
    """The fraction of the sampled tokens that came out as ASCII letters."""
    return sum(character in string.ascii_letters for character in text) / MAX_TOKENS


_clients: list = []


async def letters_agent(task: dict, rollout) -> float:
    """The agent under training: one chat call through the proxy with the plain OpenAI SDK, scored by letters_reward."""
    from openai import AsyncOpenAI

    if not _clients:  # one connection pool per runner process; each rollout gets its own base URL
        _clients.append(AsyncOpenAI(base_url="http://unused/v1", api_key="unused", max_retries=0))
    client = _clients[0].with_options(base_url=rollout.llm_base_url())
    completion = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=MAX_TOKENS, temperature=1.0)
    return letters_reward(completion.choices[0].message.content or "")


def test_the_whole_loop_learns_a_programmatic_reward(tmp_path, stack, clickhouse):
    started = time.monotonic()
    tag = uuid.uuid4().hex[:8]
    database = f"loop_{tag}"
    env = worker_env(tmp_path, stack, f"loop{tag}.", database,
                  CONFIG.format(tag=tag, group_size=GROUP_SIZE, checkpoints=tmp_path / "checkpoints"))
    create_topics(env)
    server_port, proxy_port = free_port(), free_port()
    server_url, proxy_url = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{proxy_port}"
    processes = [
        CliProcess(["serve-model", "--model", "tiny", "--port", str(server_port)], env, tmp_path / "server.log"),
        CliProcess(["proxy", "--upstream", server_url, "--port", str(proxy_port)], env, tmp_path / "proxy.log"),
        CliProcess(["train-worker"], env, tmp_path / "trainer.log"),
        CliProcess(["hotswap", "--server", server_url, "--model", "tiny"], env, tmp_path / "hotswap.log"),
        # A group of its own, as a second deployment on a shared cluster would have: the default group's other
        # members (earlier tests' runners, some killed) would rebalance this one.
        CliProcess(["run", "tests.integration.test_trainer_loop:letters_agent", "--proxy", proxy_url,
                    "--concurrency", "8", "--group", f"runners-{tag}"], env, tmp_path / "runner.log"),
    ]
    streams = Worker(env, tmp_path / "streams.log")
    try:
        for process in processes:
            process.start()
        streams.start()
        # Tasks only once the model answers: a runner fails fast on a model server still loading (a loaded Kafka
        # pass burned 1,230 of the 2,000 rollouts that way, then stalled short of the reward it waits for).
        wait_for_port("127.0.0.1", server_port, 180)
        tasks = grouped_tasks([{"id": f"task{i}", "prompt": f"Task {i}: write letters."} for i in range(250)],
                              group_size=GROUP_SIZE, timeout_s=60)
        asyncio.run(enqueue(load_config(environ=env), stack.bootstrap_servers, tasks))
        ready_s = time.monotonic() - started

        def steps() -> list[tuple]:
            return clickhouse.query(
                f"SELECT step, reward_mean, policy_version, staleness_mean, staleness_max, dropped_stale, "
                f"clip_fraction, importance_weight_mean FROM {database}.train_steps FINAL ORDER BY step").result_rows

        # What is asserted is learning, not speed: a step normally comes every 2 s, but a loaded machine took 14 s a
        # step for 17 steps. So the guard is against a stall (no step for STALL_S: longer than a GRPO group's
        # timeout plus the trainer's batch wait), with a cap on the whole run.
        stalled_at, cap, seen = time.monotonic() + STALL_S, time.monotonic() + CAP_S, 0
        while True:
            rows = steps()
            if len(rows) >= MAX_STEPS or (len(rows) >= 10 and statistics.fmean(r[1] for r in rows[-3:]) >= GOOD_ENOUGH):
                break
            if len(rows) > seen:
                seen, stalled_at = len(rows), time.monotonic() + STALL_S
            assert time.monotonic() < min(stalled_at, cap), (
                f"{seen} steps, then none for {STALL_S} s or past {CAP_S} s\n"
                + "\n".join(p.log()[-2000:] for p in processes))
            for process in processes:
                assert process.process.poll() is None, process.log()[-3000:]
            time.sleep(0.5)
        newest = clickhouse.query(f"SELECT max(policy_version) FROM {database}.spans").result_rows[0][0]
    finally:
        for process in reversed(processes):
            process.stop()
        streams.stop()
    rows = rows[:MAX_STEPS]
    first, last = statistics.fmean(r[1] for r in rows[:3]), statistics.fmean(r[1] for r in rows[-3:])
    print(f"\nsetup {ready_s:.1f}s, total {time.monotonic() - started:.1f}s, {len(rows)} steps; mean reward of the "
          f"first 3 steps {first:.3f}, of the last 3 {last:.3f}; newest policy version on a span {newest}")
    for row in rows:
        print("step {:>2} reward {:.3f} trained from v{} lag {:.2f} (max {}) dropped {} clip {:.3f} w {:.3f}"
              .format(*row))
    assert newest >= len(rows) // 2  # hot-swapped versions generated later rollouts
    assert max(row[4] for row in rows) <= 3  # the staleness bound held
    assert first < 0.3 and last > first + 0.3, (first, last)
    clickhouse.command(f"DROP DATABASE IF EXISTS {database}")
