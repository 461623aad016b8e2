"""The dev server's generation: seconds and tokens/s per SmolLM2 wave, per attention kernel and wave size.

A wave is the demo's: GRPO groups of 8 samples of ``arithmetic.MAX_TOKENS`` tokens (EOS ignored,
so every kernel does the same work) to arithmetic prompts, generated as the model server does
(``agentstream.serving.generation.generate_batch``, Linear weights in the demo's compute dtype) on
``--threads`` torch threads (1: the demo's server, beside the trainer's thread). Each kernel
(transformers' ``sdpa``; ``grouped``, the server's attention that reads the KV cache in place)
runs on the same waves, alternating, so a machine that slows down mid-run slows both. Prints
the machine's calibration, then one JSON line per kernel and wave size (the mean of ``--rounds``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from agentstream.demo.training import compute_dtype
from agentstream.examples import arithmetic
from agentstream.infra.config import load_config
from agentstream.models import eos_token_ids, load_model
from agentstream.models.precision import resolve_precision
from agentstream.serving.attention import use_grouped_attention
from agentstream.serving.generation import BatchRequest, SamplingParams, generate_batch
from agentstream.serving.tool_format import renders_tools
from agentstream.stack.machine import calibrate
from bench.common import emit
from bench.learning import task_prompt

GROUP = 8
KERNELS = ("sdpa", "grouped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="Torch threads (1: as the demo's model server runs).")
    parser.add_argument("--rounds", type=int, default=3, help="Waves measured per kernel and wave size.")
    args = parser.parse_args()
    calibration = calibrate()
    emit("generation", "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    config = load_config()
    dtype = compute_dtype(config)
    precision = resolve_precision("cpu", dtype)
    loaded = load_model("smollm2", precision=precision, threads=args.threads, inference_only=True)
    model, tokenizer = loaded.model, loaded.tokenizer
    eos, pad, native_tools = eos_token_ids(loaded), tokenizer.pad_token_id or 0, renders_tools(tokenizer)
    train, _ = arithmetic.split(heldout=config.demo.heldout_tasks)
    rng = random.Random(0)

    def wave_seconds(kernel: str, tasks: list[dict], seed: int) -> tuple[float, int]:
        model.set_attn_implementation("sdpa")
        if kernel == "grouped":
            use_grouped_attention(model)
        params = SamplingParams(max_tokens=arithmetic.MAX_TOKENS, temperature=1.0, n=GROUP, seed=seed,
                                ignore_eos=True, logprobs=True)
        requests = [BatchRequest(task_prompt(tokenizer, native_tools, task), params) for task in tasks]
        started = time.perf_counter()
        results = generate_batch(model, tokenizer, requests, eos, pad, autocast=precision.autocast)
        return time.perf_counter() - started, sum(len(state.token_ids) for states in results for state in states)

    wave_seconds("grouped", rng.sample(train, 1), 0)  # warm-up
    for prompts in (4, 8):
        seconds: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
        tokens = 0
        for round_number in range(args.rounds):
            tasks = rng.sample(train, prompts)
            for kernel in KERNELS:
                elapsed, tokens = wave_seconds(kernel, tasks, round_number)
                seconds[kernel].append(elapsed)
        for kernel in KERNELS:
            mean = statistics.mean(seconds[kernel])
            emit("generation", "wave_seconds", mean, "s", attention=kernel, rows=prompts * GROUP, tokens=tokens,
                 tokens_per_s=round(tokens / mean), dtype=dtype, threads=args.threads,
                 each=[round(s, 3) for s in seconds[kernel]])


if __name__ == "__main__":
    main()
