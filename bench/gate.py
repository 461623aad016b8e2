"""The gate's decision rules on simulated reward streams: how often each decides right or wrong, and how soon.

Canary: for each true difference D (canary - stable mean reward) it runs ``--canaries``
simulated canaries of 0/1 rewards (stable success rate ``--stable``), each live rollout going
to the canary with probability ``deploy.canary_share``, and applies the gate's rule
(:func:`agentstream.deploy.sequential.canary_bounds`, promote when the lower bound is above
-tolerance, roll back when the upper bound is below it) after every canary rollout, from
``deploy.canary_min_rollouts`` on, up to ``--horizon`` canary rollouts (then: undecided, which
the gate rolls back at ``canary_max_s``). Prints one JSON line per D: the promote, roll-back and
undecided rates, the false-promotion rate (promoted while D <= -tolerance), the false-rollback
rate (rolled back on evidence while D >= -tolerance), and the median and p90 canary rollouts
(and all rollouts) to a decision. ``naive_false_promotion`` is what the old rule, a fixed-sample
one-sided bound re-run at every look, would have done on the same streams.

Evaluation: ``--evaluations`` simulated evaluations on ``--tasks`` tasks (0/1 rewards, the two
versions' outcomes independent per task: the hardest case for a paired test) through
:func:`agentstream.deploy.sequential.paired_lower_bound`; one JSON line per D with the pass rate, the
false-pass rate (passed while D <= -tolerance) and the false-rejection rate (rejected while
D >= -tolerance). Seeded; a few seconds on one core. The simulations are tests/support/gate_simulation.py's, which
the unit tests of the bound run too.
"""

from __future__ import annotations

import argparse

import numpy as np

from agentstream.infra.config import load_config
from agentstream.stack.machine import calibrate
from bench.common import emit
from tests.support.gate_simulation import simulate_canaries, simulate_evaluations

BENCH = "gate"


def quantile(values: list[int], q: float) -> float | None:
    return float(np.quantile(values, q)) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--canaries", type=int, default=2000, help="Simulated canaries per true difference.")
    parser.add_argument("--horizon", type=int, default=4000, help="Canary rollouts before a canary is undecided.")
    parser.add_argument("--evaluations", type=int, default=20000, help="Simulated evaluations per true difference.")
    parser.add_argument("--stable", type=float, default=0.8, help="The stable version's success rate.")
    parser.add_argument("--seed", type=int, default=35)
    args = parser.parse_args()
    settings = load_config().deploy
    tolerance, alpha = settings.tolerance, round(1 - settings.confidence, 9)
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    common = dict(tolerance=tolerance, confidence=settings.confidence, stable=args.stable)
    for index, multiple in enumerate((1.0, 0.0, -0.5, -1.0, -2.0, -4.0)):
        difference = round(multiple * tolerance, 6)
        run = simulate_canaries(difference=difference, canaries=args.canaries, horizon=args.horizon,
                                seed=args.seed + index, stable=args.stable, settings=settings)
        naive = simulate_canaries(difference=difference, canaries=args.canaries, horizon=args.horizon,
                                  seed=args.seed + index, stable=args.stable, settings=settings, rule="fixed")
        worse, within = difference <= -tolerance, difference >= -tolerance
        emit(BENCH, "canary", difference, "true difference", **common, share=settings.canary_share,
             min_rollouts=settings.canary_min_rollouts, horizon_canary_rollouts=args.horizon,
             canaries=args.canaries, promoted=run.promoted / run.canaries,
             rolled_back=run.rolled_back / run.canaries, undecided=run.undecided / run.canaries,
             false_promotion=run.promoted / run.canaries if worse else None,
             false_rollback=run.rolled_back / run.canaries if within else None, guaranteed_at_most=alpha,
             naive_false_promotion=naive.promoted / naive.canaries if worse else None,
             median_canary_rollouts=quantile(run.canary_rollouts, 0.5),
             p90_canary_rollouts=quantile(run.canary_rollouts, 0.9),
             median_rollouts=quantile(run.all_rollouts, 0.5), p90_rollouts=quantile(run.all_rollouts, 0.9))
    tasks = 32
    for index, multiple in enumerate((1.0, 0.0, -0.5, -1.0, -2.0, -4.0)):
        difference = round(multiple * tolerance, 6)
        passed = simulate_evaluations(difference=difference, evaluations=args.evaluations, tasks=tasks,
                                      seed=args.seed + 100 + index, stable=args.stable, settings=settings)
        emit(BENCH, "evaluation", difference, "true difference", **common, tasks=tasks,
             evaluations=args.evaluations, passed=passed,
             false_pass=passed if difference <= -tolerance else None,
             false_rejection=1 - passed if difference >= -tolerance else None)


if __name__ == "__main__":
    main()
