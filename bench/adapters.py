"""Two trained models' LoRA adapters on one dev model server: its memory with one adapter and with two, and the cost
of switching between them.

One ``agentstream serve-model --model smollm2`` on vLLM's contract answers to two names (two
trained models of one base). Two random rank-16 LoRA adapters on every linear layer but the head
(as the online demo trains them) are loaded one after the other. The server's resident memory
(VmRSS) is read after a few requests on the base model, after requests on the first adapter, and
after requests alternating between both, so every adapter has run. Then request seconds on one
adapter at a time against alternating ones: the difference is the merge a switch costs. Prints
the machine's calibration, then one JSON line per figure; exit 1 if two adapters take more than
10% over one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from agentstream.demo.online import ALL_LINEAR
from agentstream.infra.processes import free_port
from agentstream.models import load_model
from agentstream.session import Child
from agentstream.stack.machine import calibrate, resident_mb
from bench.common import emit
from bench.fleet import wait_healthy

BOUND = 1.10  # two adapters' RSS over one's
MESSAGES = [{"role": "user", "content": "What is 12 + 30? Answer with the number."}]


def make_adapter(folder: Path, seed: int) -> None:
    """A random peft LoRA (rank 16, B non-zero) on SmolLM2's linear layers, saved to ``folder``."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = get_peft_model(load_model("smollm2").model, LoraConfig(
            r=16, lora_alpha=32, target_modules=ALL_LINEAR.split(","), init_lora_weights=False))
    model.save_pretrained(folder)


async def ask(session: aiohttp.ClientSession, url: str, model: str, tokens: int) -> float:
    """Seconds one greedy chat completion of ``tokens`` tokens takes."""
    started = time.perf_counter()
    body = {"model": model, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()
    return time.perf_counter() - started


async def measure(url: str, pid: int, home: Path, args: argparse.Namespace) -> bool:
    async with aiohttp.ClientSession() as session:
        async def load(name: str, folder: Path) -> None:
            body = {"lora_name": name, "lora_path": str(folder)}
            async with session.post(f"{url}/v1/load_lora_adapter", json=body) as response:
                assert response.status == 200, await response.text()

        for _ in range(3):
            await ask(session, url, "calc", args.tokens)
        base = resident_mb(pid)
        emit("adapters", "server_rss_base_model", base, "MB")
        await load("calc@v1", home / "calc")
        for _ in range(3):
            await ask(session, url, "calc@v1", args.tokens)
        one = resident_mb(pid)
        emit("adapters", "server_rss_one_adapter", one, "MB", over_base_mb=round(one - base, 1))
        await load("words@v1", home / "words")
        for model in ("words@v1", "calc@v1") * 3:
            await ask(session, url, model, args.tokens)
        two = resident_mb(pid)
        emit("adapters", "server_rss_two_adapters", two, "MB", over_one_mb=round(two - one, 1),
             ratio_to_one=round(two / one, 3), bound=BOUND)
        same = [await ask(session, url, "calc@v1", args.tokens) for _ in range(args.rounds)]
        alternating = [await ask(session, url, model, args.tokens) for model in ("words@v1", "calc@v1") * args.rounds]
        emit("adapters", "request_s_same_adapter", statistics.mean(same), "s", tokens=args.tokens)
        emit("adapters", "request_s_alternating_adapters", statistics.mean(alternating), "s", tokens=args.tokens,
             switch_cost_s=round(statistics.mean(alternating) - statistics.mean(same), 3))
    return two <= BOUND * one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="The server's torch threads.")
    parser.add_argument("--tokens", type=int, default=16, help="Tokens per request.")
    parser.add_argument("--rounds", type=int, default=4, help="Requests per way of timing them.")
    args = parser.parse_args()
    calibration = calibrate()
    emit("adapters", "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    with tempfile.TemporaryDirectory(prefix="agentstream-adapters-") as folder:
        home = Path(folder)
        for name, seed in (("calc", 0), ("words", 1)):
            make_adapter(home / name, seed)
        port = free_port()
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("AGENTSTREAM_")}  # none of the caller's
        server = Child("serve-model", ["serve-model", "--model", "smollm2", "--port", str(port), "--contract", "vllm",
                                       "--served-model-name", "calc", "--served-model-name", "words",
                                       "--threads", str(args.threads)],
                       {**inherited, "AGENTSTREAM_HOME": str(home)}, home / "serve-model.log").start()
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(server, url, 300)
            assert server.process is not None
            within = asyncio.run(measure(url, server.process.pid, home, args))
        finally:
            server.stop()
    sys.exit(0 if within else 1)


if __name__ == "__main__":
    main()
