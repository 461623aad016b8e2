"""Drift by framework: the calculator agent on each framework, the same tasks, through the proxy to the dev server.

Each framework's agent (the plain OpenAI SDK; the OpenAI Agents SDK and PydanticAI on the Responses API; a
LangGraph ReAct agent over ChatOpenAI) runs the same held-out calculator tasks, sampled at ``--temperature``
(0.5, the demo's), through the capturing proxy in front of the dev server. From the LLM spans of each rollout it
prints, per framework: LLM calls per rollout, the prefix merges and breaks between a rollout's consecutive calls
(a merge: the next prompt starts with the previous prompt and response ids, so trajectory-level samples merge),
the break rate, generated tokens per rollout, the mean reward, and why the breaks happened: the tokens the
previous call generated against the tokens the next prompt has at the first place they differ.

An untrained SmolLM2-135M does not call the tool (one call per rollout, nothing to merge), so drift is
measured on a warm-started checkpoint, as the calculator demo makes one: ``--weights`` names its folder (or
its ``model.safetensors``), full weights as the trainer writes them.

Prints the machine's calibration, then one JSON line per figure and framework.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

from agentstream.examples import CALCULATOR_FRAMEWORKS, calculator_agent
from agentstream.models import FULL_WEIGHTS_FILE, LoadedModel, load_model
from agentstream.models.weights import assign_weights, read_weights
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.sdk import Rollout
from agentstream.serving.app import create_app
from agentstream.stack.machine import calibrate
from bench.common import emit
from tests.support.http_thread import ServerThread
from tests.support.sinks import ListSink

BENCH = "framework_drift"
REASON_TOKENS = 3


def first_difference(earlier: dict[str, Any], later: dict[str, Any]) -> int | None:
    """Where ``later``'s prompt stops repeating ``earlier``'s prompt and response ids; None when it repeats them."""
    seen = list(earlier["prompt_token_ids"]) + list(earlier["response_token_ids"])
    prompt = list(later["prompt_token_ids"])
    for index, (a, b) in enumerate(zip(seen, prompt, strict=False)):
        if a != b:
            return index
    return None if len(prompt) >= len(seen) else len(prompt)


def why(loaded: LoadedModel, earlier: dict[str, Any], later: dict[str, Any], index: int) -> str:
    """A break as text: what the previous call had at the first difference, and what the next prompt has there."""
    seen = list(earlier["prompt_token_ids"]) + list(earlier["response_token_ids"])
    had = loaded.tokenizer.decode(seen[index:index + REASON_TOKENS])
    has = loaded.tokenizer.decode(list(later["prompt_token_ids"])[index:index + REASON_TOKENS])
    return f"{had!r} -> {has!r}"


async def run_framework(agent: Any, tasks: list[dict], proxy_url: str, concurrency: int) -> list[float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(task: dict) -> float:
        async with gate:
            rollout_id = f"{task['framework']}-{task['id']}"
            return await agent.solve(task, Rollout(rollout_id, f"{rollout_id}-1", proxy_url=proxy_url))

    return list(await asyncio.gather(*(one(task) for task in tasks)))


def report(framework: str, loaded: LoadedModel, spans: list[dict[str, Any]], rewards: list[float],
           seconds: float) -> None:
    rollouts: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        if span.get("kind") == "LLM":
            rollouts.setdefault(span["rollout_id"], []).append(span)
    merges, breaks, reasons = 0, 0, Counter[str]()
    for calls in rollouts.values():
        calls.sort(key=lambda span: span["start_time_us"])
        for earlier, later in pairwise(calls):
            index = first_difference(earlier, later)
            if index is None:
                merges += 1
            else:
                breaks += 1
                reasons[why(loaded, earlier, later, index)] += 1
    count = max(1, len(rollouts))
    calls = sum(len(spans) for spans in rollouts.values())
    generated = sum(len(span["response_token_ids"]) for spans in rollouts.values() for span in spans)
    extra = {"framework": framework, "rollouts": len(rollouts)}
    emit(BENCH, "llm_calls_per_rollout", calls / count, "calls", **extra)
    emit(BENCH, "prefix_merges", merges, "pairs", **extra)
    emit(BENCH, "prefix_breaks", breaks, "pairs", **extra)
    emit(BENCH, "break_rate", breaks / (merges + breaks) if merges + breaks else None, "ratio", **extra)
    emit(BENCH, "generated_tokens_per_rollout", generated / count, "tokens", **extra)
    emit(BENCH, "reward_mean", sum(rewards) / max(1, len(rewards)), "reward", **extra)
    emit(BENCH, "seconds", seconds, "s", **extra)
    emit(BENCH, "break_reasons", breaks, "pairs",
         reasons=[{"reason": reason, "count": n} for reason, n in reasons.most_common(5)], **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="The dev server's model (smollm2, or tiny for a smoke run).")
    parser.add_argument("--tasks", type=int, default=32, help="Held-out calculator tasks each framework runs.")
    parser.add_argument("--frameworks", nargs="+", choices=list(CALCULATOR_FRAMEWORKS),
                        default=list(CALCULATOR_FRAMEWORKS))
    parser.add_argument("--temperature", type=float, default=0.5,
                        help="Sampling temperature of every call (the calculator demo's agent runs at 0.5).")
    parser.add_argument("--concurrency", type=int, default=8, help="Rollouts of one framework at a time.")
    parser.add_argument("--weights", type=Path, default=None,
                        help=f"A checkpoint folder (or its {FULL_WEIGHTS_FILE}) to serve instead of the base weights.")
    args = parser.parse_args()
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    loaded = load_model(args.model)
    if args.weights is not None:
        folder = args.weights if args.weights.is_dir() else args.weights.parent
        assign_weights(loaded.model, read_weights(folder))
        emit(BENCH, "weights", None, "", folder=str(folder))
    server = ServerThread(create_app(loaded))
    try:
        _, heldout = calculator_agent.split()
        for framework in args.frameworks:
            sink = ListSink()
            proxy = ServerThread(LLMProxy(server.url, sink).app)
            tasks = [{**task, "framework": framework, "model": loaded.name, "temperature": args.temperature}
                     for task in heldout[:args.tasks]]
            started = time.monotonic()
            try:
                agent = importlib.import_module(CALCULATOR_FRAMEWORKS[framework])
                rewards = asyncio.run(run_framework(agent, tasks, proxy.url, args.concurrency))
            finally:
                proxy.stop()
            report(framework, loaded, sink.spans, rewards, time.monotonic() - started)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
