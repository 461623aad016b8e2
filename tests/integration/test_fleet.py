"""The fleet on one machine: every role its own process and home folder, checkpoints only through the object store.

Each role is the operator's command (`agentstream serve-model` twice, `proxy` over both,
`streams` twice in one consumer group, `torchrun --nproc-per-node 2 -m agentstream train-worker`
on gloo, `run` twice through the proxy, and beside each server a `hotswap --server` of its own),
started in a folder of its own that is its working directory and its AGENTSTREAM_HOME, with its
own configuration file. The broker and ClickHouse are shared by URL; checkpoints go from the
trainer to the object store (the stack's kind, on a port of its own, checking signatures) and
from there into each hot swap's cache, the only roles given its endpoint and keys. A server and
its hot swap are a host (``host-N``): hot swap hands its server folders of its cache, as it must
for vLLM, and the two hosts have no file in common.

Under load one host is lost (its model server and hot swap SIGKILLed, its folders emptied) and
started again, the server on its port: no user request fails, the trainer keeps publishing, the
new hot swap brings the server to the deployed version from the object store alone, and the
proxy sends it calls again.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from agentstream.deploy.deployments import read_routes
from agentstream.infra.checkpoint_store import MANIFEST, sha256_file
from agentstream.infra.config import CHECKPOINT_BUCKET, load_config
from agentstream.infra.processes import free_port
from agentstream.pipeline.proxy.upstreams import missing, survey
from agentstream.pipeline.runner.tasks import enqueue, grouped_tasks
from agentstream.serving.protocol import Contract
from tests.integration.test_hotswap_reconcile import TOKEN, ModelServerProcess
from tests.support.s3_checkpoints import KEY_ID, SECRET, EmbeddedStore
from tests.support.streams_harness import CliProcess, Worker, create_topics, wait_for, worker_env
from tests.support.torchrun import Torchrun

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"  # tests.integration.test_trainer_loop:letters_agent asks for it
CHECKPOINT_FILES = {MANIFEST, "model.safetensors", "optimizer.pt"}
CONFIG = """
[topics]
partitions = 2  # two stream workers and two runners each get one

[streams]
app_id = "streams-{tag}"
grace_s = 0.2
session_timeout_s = 3

[trainer]
model = "tiny"
device = "cpu"
threads = 1
lr = 0.003
batch_transitions = 8
batch_tokens = 0
batch_wait_s = 5
max_policy_lag = 1000
checkpoint_every_steps = 1
checkpoint_dir = "{location}"
session_timeout_s = 3
distributed_timeout_s = 60

[deploy]
gate = false
reconcile_s = 0.5
"""
OBJECT_STORE = """
[checkpoints]
s3_endpoint = "{endpoint}"
s3_access_key_id = "{key_id}"
s3_secret_access_key = "{secret}"
"""


@dataclass
class Role:
    """A role's folder: its configuration file beside its home (its working directory and AGENTSTREAM_HOME)."""

    env: dict
    home: Path


def role(folder: Path, stack, tag: str, config: str) -> Role:
    folder.mkdir(parents=True)
    env = worker_env(folder, stack, f"fleet{tag}.", f"fleet_{tag}", config)
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               OMP_NUM_THREADS="1", AGENTSTREAM_ADMIN_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    home = Path(env["AGENTSTREAM_HOME"])
    home.mkdir()
    return Role(env, home)


def files_under(home: Path) -> list[Path]:
    return sorted(path.relative_to(home) for path in home.rglob("*") if path.is_file())


@pytest.mark.scenario
def test_a_fleet_loses_a_model_server_under_load_and_no_request_fails(tmp_path, stack, clickhouse):
    started = time.monotonic()
    tag = uuid.uuid4().hex[:8]
    objects = EmbeddedStore(tmp_path / "objects")
    location = f"s3://{CHECKPOINT_BUCKET}/fleet-{tag}"
    logs = tmp_path / "logs"
    logs.mkdir()
    shared = CONFIG.format(tag=tag, location=location)
    with_store = shared + OBJECT_STORE.format(endpoint=objects.url, key_id=KEY_ID, secret=SECRET)
    folders = {name: tmp_path / name for name in ("proxy", "streams-0", "streams-1", "trainer", "runner-0",
                                                   "runner-1")} | {f"hotswap-{i}": tmp_path / f"host-{i}" / "hotswap"
                                                                   for i in range(2)}
    roles = {name: role(folder, stack, tag, with_store if name == "trainer" or name.startswith("hotswap") else shared)
             for name, folder in folders.items()}
    create_topics(roles["proxy"].env)
    servers = [ModelServerProcess(MODEL, Contract.DEV, tmp_path / f"host-{i}" / "server") for i in range(2)]
    for server in servers:
        server.home.mkdir(parents=True)
    urls = [server.url for server in servers]
    proxy_url = f"http://127.0.0.1:{(proxy_port := free_port())}"

    def cli(name: str, *args: str) -> CliProcess:
        return CliProcess(list(args), roles[name].env, logs / f"{name}.log", cwd=roles[name].home)

    proxy = cli("proxy", "proxy", *(arg for url in urls for arg in ("--upstream", url)), "--port", str(proxy_port))
    hotswaps = [cli(f"hotswap-{i}", "hotswap", "--server", url, "--model", MODEL) for i, url in enumerate(urls)]
    runners = [cli(f"runner-{i}", "run", "tests.integration.test_trainer_loop:letters_agent", "--proxy", proxy_url,
                   "--concurrency", "4", "--group", f"fleet-runners-{tag}") for i in range(2)]
    streams = [Worker(roles[f"streams-{i}"].env, logs / f"streams-{i}.log", cwd=roles[f"streams-{i}"].home)
               for i in range(2)]
    trainer = Torchrun(["--nproc-per-node", "2"], ["train-worker"], roles["trainer"].env, logs / "trainer.log",
                       cwd=roles["trainer"].home)
    processes = [proxy, *hotswaps, *runners]
    config = load_config(environ=roles["proxy"].env)
    store = S3Reader(objects, location)
    try:
        for server in servers:
            server.start()
        trainer.start()
        for process in processes:
            process.start()
        for worker in streams:
            worker.start(timeout_s=90)
        asyncio.run(ready(servers))
        tasks = grouped_tasks([{"id": f"task{i}", "prompt": f"Task {i}: write letters."} for i in range(3000)],
                              group_size=1, timeout_s=60)
        asyncio.run(enqueue(config, stack.bootstrap_servers, tasks))
        ready_s = time.monotonic() - started

        def deployed() -> int:
            routing = asyncio.run(read_routes(config, stack.bootstrap_servers)).get(MODEL)
            return 0 if routing is None else routing.stable_version

        wait_for(lambda: deployed() >= 2, 120, what="v2 deployed")
        wait_for(lambda: asyncio.run(proxy_health(proxy_url))[urls[1]] > 0, 30, 0.02,
                 what="a call in flight on the second server")
        killed, its_hotswap = servers[1], hotswaps[1]
        killed.kill()  # SIGKILL, with calls in flight
        its_hotswap.kill()
        killed_at, published_at_kill = time.time(), store.newest()
        for home in (killed.home, roles["hotswap-1"].home):  # a new host: no cache, nothing of the first run
            shutil.rmtree(home)
            home.mkdir()
        wait_for(lambda: store.newest() >= published_at_kill + 2, 60, what="two more checkpoints after the kill")
        killed.start()
        its_hotswap.start()
        asyncio.run(ready([killed]))
        restarted_at = time.time()

        def back_on_current() -> bool:
            routes = asyncio.run(read_routes(config, stack.bootstrap_servers))
            replica = asyncio.run(survey([killed.url]))[0]
            return replica.version is not None and replica.version > 0 and not missing(replica, routes[MODEL])

        wait_for(back_on_current, 60, what="the restarted server on the deployed version")
        restored_s = time.time() - restarted_at
        listed = subprocess.run([sys.executable, "-m", "agentstream", "deployments", "--model", MODEL, "--history",
                                 "0", *(arg for url in urls for arg in ("--server", url))], env=roles["proxy"].env,
                                cwd=roles["proxy"].home, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr
        assert re.search(rf"{re.escape(killed.url)}\s+yes\s+\d+", listed.stdout), listed.stdout

        def served_by_restarted() -> int:
            return clickhouse.query(
                f"SELECT count() FROM fleet_{tag}.spans WHERE kind = 'LLM' AND start_time > "
                f"fromUnixTimestamp64Micro({int(restarted_at * 1e6)}) "
                f"AND attributes['agentstream.upstream'] = {{url:String}}", parameters={"url": killed.url}
            ).result_rows[0][0]

        wait_for(served_by_restarted, 60, what="calls served by the restarted server")
        for runner in runners:  # they finish the rollouts in flight
            runner.stop(60)
        newest = store.newest()
    finally:
        for process in reversed(processes):
            process.stop()
        trainer.stop()
        for worker in streams:
            worker.stop()
        for server in servers:
            server.kill()
        objects.stop()
    outcomes = [finished(runner.log()) for runner in runners]
    rollouts = sum(outcome["finished"] for outcome in outcomes)
    assert all(o["failed"] == o["timed_out"] == 0 and o["succeeded"] == o["finished"] > 0 for o in outcomes), outcomes
    llm = dict(clickhouse.query(
        f"SELECT status, count() FROM fleet_{tag}.spans WHERE kind = 'LLM' GROUP BY status").result_rows)
    assert set(llm) == {"OK"}, llm
    retried = clickhouse.query(
        f"SELECT count() FROM fleet_{tag}.spans WHERE kind = 'LLM' AND attributes['agentstream.upstream.retried'] = "
        f"'true' AND start_time >= fromUnixTimestamp64Micro({int(killed_at * 1e6) - 30_000_000})").result_rows[0][0]
    assert retried >= 1, "the calls in flight on the killed server were answered by the other"
    assert newest >= published_at_kill + 2
    assert_no_files_in_common(roles, servers, store, tmp_path)
    print(f"\nfleet: ready in {ready_s:.1f} s, {rollouts} rollouts ({llm['OK']} LLM calls, 0 failed, {retried} retried "
          f"on the other server after the SIGKILL); checkpoints v{published_at_kill} at the kill, v{newest} at the "
          f"end; the restarted server on the deployed version {restored_s:.1f} s after it answered; "
          f"total {time.monotonic() - started:.1f} s")
    clickhouse.command(f"DROP DATABASE IF EXISTS fleet_{tag}")


class S3Reader:
    """What the trainer has put in the object store, read from the object store's own folder."""

    def __init__(self, objects: EmbeddedStore, location: str) -> None:
        self.folder = objects.object_path(f"{location.removeprefix(f's3://{CHECKPOINT_BUCKET}/')}/{MODEL}")

    def manifests(self) -> dict[int, dict]:
        """Each stored version's manifest, by version."""
        found = (json.loads(path.read_text()) for path in self.folder.glob(f"*/{MANIFEST}"))
        return {manifest["version"]: manifest for manifest in found}

    def newest(self) -> int:
        return max(self.manifests(), default=0)


def assert_no_files_in_common(roles: dict[str, Role], servers: list[ModelServerProcess], store: S3Reader,
                              tmp_path: Path) -> None:
    """Checkpoint files are in the object store and each hot swap's cache only, each as the manifest says."""
    homes = {name: r.home for name, r in roles.items()} | {f"server-{i}": s.home for i, s in enumerate(servers)}
    holding = {name for name, home in homes.items() if any(p.name in CHECKPOINT_FILES for p in files_under(home))}
    assert holding == {"hotswap-0", "hotswap-1"}, holding  # the trainer's staging folders are gone once uploaded
    manifests = store.manifests()
    cached = {name: [folder for folder in homes[name].rglob("*") if folder.is_dir() and (folder / MANIFEST).is_file()]
              for name in holding}
    assert all(cached.values()), cached
    for folder in (folder for folders in cached.values() for folder in folders):
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest == manifests[manifest["version"]]
        assert {name: sha256_file(folder / name) for name in manifest["files"]} == manifest["files"]
        assert sha256_file(folder / manifest["weights_file"]) == manifest["sha256"]
    for server in servers:  # a model server writes nothing: its folder holds only the log the test gave it
        assert all(path.name.startswith("model-server-") for path in files_under(server.home)), \
            files_under(server.home)
    top = {name for name in roles if not name.startswith("hotswap")}
    assert {path.name for path in tmp_path.iterdir()} == {*top, "host-0", "host-1", "objects", "logs"}
    assert all({path.name for path in (tmp_path / host).iterdir()} == {"hotswap", "server"}
               for host in ("host-0", "host-1"))


def finished(log: str) -> dict[str, int]:
    """The runner's last line: how many rollouts it finished, and how."""
    found = re.search(r"finished (\d+) rollouts: (\d+) succeeded, (\d+) failed, (\d+) timed out", log)
    assert found, log[-3000:]
    return dict(zip(("finished", "succeeded", "failed", "timed_out"), map(int, found.groups()), strict=True))


async def ready(servers: list[ModelServerProcess]) -> None:
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(server.ready(session) for server in servers))


async def proxy_health(url: str) -> dict[str, int]:
    """The calls in flight on each model server, as the proxy's /health says."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as response:
        body = await response.json()
    return {upstream["url"]: upstream["outstanding"] for upstream in body["upstreams"]}

