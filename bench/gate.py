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
D >= -tolerance). Seeded; a few seconds on one core.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from agentstream.deploy.sequential import canary_bounds, paired_lower_bound
from agentstream.infra.config import DeployConfig, load_config
from agentstream.stack.machine import calibrate
from bench.common import emit

BENCH = "gate"
CHUNK = 200  # canary rollouts simulated at once for every run still undecided


@dataclass(frozen=True)
class Outcomes:
    """What a batch of simulated canaries came to: counts, and the rollouts each decided one took."""

    canaries: int
    promoted: int
    rolled_back: int
    canary_rollouts: list[int]
    all_rollouts: list[int]

    @property
    def undecided(self) -> int:
        return self.canaries - self.promoted - self.rolled_back


def simulate_canaries(*, difference: float, canaries: int, horizon: int, seed: int, stable: float = 0.8,
                      settings: DeployConfig | None = None, rule: str = "sequential") -> Outcomes:
    """Run ``canaries`` simulated canaries at a true difference; ``rule`` "fixed" is the old repeated fixed test."""
    settings = settings or DeployConfig()
    rng = np.random.default_rng(seed)
    p_canary = min(1.0, max(0.0, stable + difference))
    n_s = np.zeros(canaries)
    s_c = np.zeros(canaries)
    s_s = np.zeros(canaries)
    decided = np.zeros(canaries, dtype=np.int8)  # 0 undecided, 1 promoted, -1 rolled back
    at_canary = np.zeros(canaries, dtype=np.int64)
    at_all = np.zeros(canaries, dtype=np.int64)
    z = NormalDist().inv_cdf(settings.confidence)
    for first in range(1, horizon + 1, CHUNK):
        open_ = np.flatnonzero(decided == 0)
        if open_.size == 0:
            break
        width = min(CHUNK, horizon - first + 1)
        k = np.arange(first, first + width, dtype=np.float64)  # canary rollouts at each look
        canary_sum = s_c[open_, None] + np.cumsum(rng.random((open_.size, width)) < p_canary, axis=1)
        between = rng.geometric(settings.canary_share, (open_.size, width)) - 1  # stable rollouts in between
        stable_n = n_s[open_, None] + np.cumsum(between, axis=1)
        stable_sum = s_s[open_, None] + np.cumsum(rng.binomial(between, stable), axis=1)
        s_c[open_], n_s[open_], s_s[open_] = canary_sum[:, -1], stable_n[:, -1], stable_sum[:, -1]
        with np.errstate(divide="ignore", invalid="ignore"):
            mean_c, mean_s = canary_sum / k, stable_sum / stable_n
            var_c = mean_c * (1 - mean_c) * k / (k - 1)
            var_s = mean_s * (1 - mean_s) * stable_n / (stable_n - 1)
            if rule == "fixed":
                d = mean_c - mean_s
                spread = z * np.sqrt(var_c / k + var_s / stable_n)
                lower, upper = d - spread, d + spread
            else:
                _, lower, upper = canary_bounds(k, mean_c, var_c, stable_n, mean_s, var_s,
                                                tolerance=settings.tolerance, confidence=settings.confidence)
        may_look = (k >= settings.canary_min_rollouts) & (stable_n >= 2)
        # The gate's rule (deploy.sequential.canary_verdict): promote first, then roll back.
        promote = may_look & (lower > -settings.tolerance)
        roll_back = may_look & ~promote & (upper < -settings.tolerance)
        hit = promote | roll_back
        rows = np.flatnonzero(hit.any(axis=1))
        column = hit[rows].argmax(axis=1)
        runs = open_[rows]
        decided[runs] = np.where(promote[rows, column], 1, -1)
        at_canary[runs] = k[column].astype(np.int64)
        at_all[runs] = at_canary[runs] + stable_n[rows, column].astype(np.int64)
    done = decided != 0
    return Outcomes(canaries, int((decided == 1).sum()), int((decided == -1).sum()),
                    at_canary[done].tolist(), at_all[done].tolist())


def simulate_evaluations(*, difference: float, evaluations: int, tasks: int, seed: int, stable: float = 0.8,
                         settings: DeployConfig | None = None) -> float:
    """The share of ``evaluations`` simulated evaluations on ``tasks`` tasks that the gate's paired rule passes."""
    settings = settings or DeployConfig()
    rng = np.random.default_rng(seed)
    p_candidate = min(1.0, max(0.0, stable + difference))
    differences = ((rng.random((evaluations, tasks)) < p_candidate).astype(np.float64)
                   - (rng.random((evaluations, tasks)) < stable))
    lower = paired_lower_bound(differences.mean(axis=1), differences.var(axis=1, ddof=1), tasks, settings.confidence)
    return float((lower > -settings.tolerance).mean())


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
