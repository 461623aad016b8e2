"""Multi-step learning, side by side in one run: transition vs trajectory level, final vs intermediate reward.

Each variant is the calculator demo (``agentstream demo --agent calculator``: warm start on
demonstrations sent through the pipeline, then RL on "Compute a*b+d." with the calculator tool)
for ``--seconds`` of training in all, on a fresh stack, one after the other on the same machine:

- ``trajectory``: GRPO on the final reward, successive calls merged into one masked sample;
- ``transition``: GRPO on the final reward, one sample per LLM call;
- ``intermediate``: trajectory level, ``discounted`` credit (gamma 1) on the final reward plus a
  0.1 reward for a first turn whose calculator calls all worked (``examples/calculator_shaped.py``).

Per variant, after a machine calibration line: held-out greedy success before, after the warm
start and after RL (and by policy version), the time to ``--target`` points over the warm start,
tokens forwarded per second of optimizer steps, LLM calls per rollout at the end, and the
prefix merges and breaks (the break rate is the retokenization drift of SmolLM2's template on
the dev server). Prints JSON lines.
"""

from __future__ import annotations

import argparse
import signal
from dataclasses import replace

from agentstream.demo import run_demo
from agentstream.demo.training import AGENTS, DemoAgent, DemoReport
from bench.common import emit
from infra.config import ConfigError, load_config
from stack.machine import calibrate

CALCULATOR = AGENTS["calculator"]
VARIANTS: dict[str, DemoAgent] = {
    "trajectory": CALCULATOR,
    "transition": replace(CALCULATOR, level="transition"),
    "intermediate": replace(CALCULATOR, entry="examples.calculator_shaped:solve", strategy="discounted"),
}


def time_to_gain(report: DemoReport, gain: float) -> float | None:
    """Seconds of training until held-out success is ``gain`` over the warm-started agent's (None: never)."""
    if report.heldout_warm_start is None:
        return None
    goal = report.heldout_warm_start + gain
    return next((e.seconds for e in report.evaluations[2:] if e.accuracy >= goal - 1e-9), None)


def report_variant(name: str, report: DemoReport, gain: float) -> None:
    merges, breaks = report.prefix_merges, report.prefix_breaks
    emit("multistep", "heldout_after", report.heldout_after, "share", variant=name,
         before=report.heldout_before, warm_start=report.heldout_warm_start,
         gain_over_warm_start=(round(report.heldout_after - report.heldout_warm_start, 4)
                               if report.heldout_warm_start is not None else None),
         accuracy_by_version=[[e.policy_version, e.accuracy] for e in report.evaluations],
         policy_versions=report.policy_versions, training_seconds=report.training_seconds,
         warm_start_seconds=report.warm_start_seconds)
    emit("multistep", f"time_to_plus_{round(gain * 100)}_points_s", time_to_gain(report, gain), "s", variant=name)
    emit("multistep", "train_tokens_per_s", report.train_tokens_per_s, "tokens/s", variant=name)
    emit("multistep", "llm_calls_per_rollout", report.llm_calls_per_rollout, "calls", variant=name)
    emit("multistep", "prefix_break_rate", breaks / (merges + breaks) if merges + breaks else None, "share",
         variant=name, merges=merges, breaks=breaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=900.0,
                        help="Each variant's training time, warm start included.")
    parser.add_argument("--eval-every", type=float, default=150.0, help="Seconds between held-out evaluations.")
    parser.add_argument("--gain", type=float, default=0.3, help="The gain over the warm start that is timed.")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"Comma-separated, run in this order (default: {','.join(VARIANTS)}).")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown or not chosen:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: the demo's stack goes down with it
    try:
        config = load_config()
        config = replace(config, demo=replace(config.demo, quick=False, seconds=args.seconds,
                                              eval_every_s=args.eval_every, output_dir="bench-output",
                                              report_path="bench-output/multistep-report.json"))
    except ConfigError as error:
        parser.error(str(error))
    calibration = calibrate()
    emit("multistep", "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    for name in chosen:
        print(f"variant {name}: {args.seconds:.0f} s of training", flush=True)
        report_variant(name, run_demo(config, agent=VARIANTS[name]), args.gain)


if __name__ == "__main__":
    main()
