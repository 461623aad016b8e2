"""The gate's decision rules on simulated 0/1 reward streams, as ``bench.gate`` measures them and tests check them.

:func:`simulate_canaries` runs simulated canaries through the gate's sequential rule
(:func:`agentstream.deploy.sequential.canary_bounds`) after every canary rollout, or through the old fixed-sample
rule re-run at every look; :func:`simulate_evaluations` runs simulated paired evaluations through
:func:`agentstream.deploy.sequential.paired_lower_bound`. Seeded numpy; no service.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from agentstream.deploy.sequential import canary_bounds, paired_lower_bound
from agentstream.infra.config import DeployConfig

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
