"""Multi-step learning, side by side in one run: transition vs trajectory level, final vs intermediate reward.

Each variant is the calculator demo (``agentstream demo --agent calculator``: warm start on
demonstrations sent through the pipeline, then RL on "Compute a*b+d." with the calculator tool)
for ``--seconds`` of RL after its warm start, on a fresh stack, one after the other on the same machine:

- ``trajectory``: GRPO on the final reward, successive calls merged into one masked sample;
- ``transition``: GRPO on the final reward, one sample per LLM call;
- ``intermediate``: trajectory level, ``discounted`` credit (gamma 1) on the final reward plus a
  0.1 reward for a first turn whose calculator calls all worked (``examples/calculator_shaped.py``);
- ``trajectory-16`` (not run by default): ``trajectory`` with 16 samples per optimizer step, so
  that it steps as often on the same rollouts as ``transition`` does with 32 (two calls each).

Per variant, after a machine calibration line: held-out success (T=0.5, as the demo judges it)
before, after the warm start and after RL, by time and policy version; the time from the start of
training (warm start included) to each ``--targets`` success, the fair comparison across levels
because the same demonstrations make a different warm start at each level (one sample per call
at transition level: twice the optimizer steps on two-call demonstrations); the time to
``--gain`` points over the warm-started agent; tokens forwarded per second of optimizer steps;
LLM calls per rollout at the end; and the prefix merges and breaks (the break rate is the
retokenization drift of SmolLM2's template on the dev server). Each variant's demo report is
kept in ``bench-output/multistep-<variant>.json``. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import signal
from dataclasses import replace

from agentstream.demo import run_demo
from agentstream.demo.agents import AGENTS, DemoAgent
from agentstream.demo.results import DemoReport
from agentstream.infra.config import ConfigError, load_config
from agentstream.stack.machine import calibrate
from bench.common import emit

CALCULATOR = AGENTS["calculator"]
VARIANTS: dict[str, DemoAgent] = {
    "trajectory": CALCULATOR,
    "transition": replace(CALCULATOR, level="transition"),
    "intermediate": replace(CALCULATOR, entry="agentstream.examples.calculator_shaped:solve", strategy="discounted"),
    # a step of 32 samples holds 32 rollouts at trajectory level and about 16 at transition level (two calls
    # each): with 16, trajectory level takes the same optimizer steps on the same rollouts, warm start included
    "trajectory-16": replace(CALCULATOR, samples_per_step=16),
}
DEFAULT_VARIANTS = ("trajectory", "transition", "intermediate")


def time_to_success(report: DemoReport, target: float) -> float | None:
    """Seconds from the start of training (the warm start's included) until held-out success reaches ``target``."""
    warm = report.warm_start_seconds or 0.0
    return next((warm + e.seconds for e in report.evaluations[1:] if e.accuracy >= target - 1e-9), None)


def time_to_gain(report: DemoReport, gain: float) -> float | None:
    """Seconds of RL until held-out success is ``gain`` over the warm-started agent's (None: never)."""
    if report.heldout_warm_start is None:
        return None
    goal = report.heldout_warm_start + gain
    return next((e.seconds for e in report.evaluations[2:] if e.accuracy >= goal - 1e-9), None)


def report_variant(name: str, report: DemoReport, gain: float, targets: list[float]) -> None:
    merges, breaks = report.prefix_merges, report.prefix_breaks
    emit("multistep", "heldout_after", report.heldout_after, "share", variant=name,
         before=report.heldout_before, warm_start=report.heldout_warm_start,
         gain_over_warm_start=(round(report.heldout_after - report.heldout_warm_start, 4)
                               if report.heldout_warm_start is not None else None),
         accuracy_by_time=[[e.seconds, e.policy_version, e.accuracy] for e in report.evaluations],
         policy_versions=report.policy_versions, training_seconds=report.training_seconds,
         warm_start_seconds=report.warm_start_seconds)
    for target in targets:
        emit("multistep", f"time_to_{round(target * 100)}pct_s", time_to_success(report, target), "s", variant=name)
    emit("multistep", f"time_to_plus_{round(gain * 100)}_points_s", time_to_gain(report, gain), "s", variant=name)
    emit("multistep", "train_tokens_per_s", report.train_tokens_per_s, "tokens/s", variant=name)
    emit("multistep", "llm_calls_per_rollout", report.llm_calls_per_rollout, "calls", variant=name)
    emit("multistep", "prefix_break_rate", breaks / (merges + breaks) if merges + breaks else None, "share",
         variant=name, merges=merges, breaks=breaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=900.0,
                        help="Each variant's RL time (the warm start is off its clock).")
    parser.add_argument("--eval-every", type=float, default=150.0, help="Seconds between held-out evaluations.")
    parser.add_argument("--targets", default="0.8,0.9",
                        help="Comma-separated held-out success levels timed from the start of training.")
    parser.add_argument("--gain", type=float, default=0.3, help="The gain over the warm start that is timed.")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"Comma-separated, run in this order, of {', '.join(VARIANTS)} "
                             f"(default: {','.join(DEFAULT_VARIANTS)}).")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown or not chosen:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    try:
        targets = [float(target) for target in args.targets.split(",") if target.strip()]
    except ValueError:
        parser.error(f"--targets: comma-separated numbers between 0 and 1, not {args.targets!r}")
    if not all(0 < target <= 1 for target in targets):
        parser.error(f"--targets: each between 0 and 1, not {args.targets!r}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: the demo's stack goes down with it
    try:
        config = load_config()
        config = replace(config, demo=replace(config.demo, quick=False, seconds=args.seconds,
                                              eval_every_s=args.eval_every, output_dir="bench-output"))
    except ConfigError as error:
        parser.error(str(error))
    calibration = calibrate()
    emit("multistep", "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    for name in chosen:
        print(f"variant {name}: {args.seconds:.0f} s of training", flush=True)
        variant_config = replace(config, demo=replace(config.demo, report_path=f"bench-output/multistep-{name}.json"))
        report_variant(name, run_demo(variant_config, agent=VARIANTS[name]), args.gain, targets)


if __name__ == "__main__":
    main()
