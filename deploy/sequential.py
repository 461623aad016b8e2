"""The gate's statistics: an always-valid bound for the canary and a paired bound for the offline evaluation.

Both decide non-inferiority: is the new version's mean reward no worse than the stable
version's minus ``tolerance``, at ``confidence``? Pure functions of counts, means and
variances (floats or numpy arrays of them), so the gate and ``bench.gate`` run the same code.

**Canary** (live rewards, looked at as often as the gate likes). The difference of means
d = mean_canary - mean_stable has the Welch variance V = var_c/n_c + var_s/n_s. The
normal-mixture confidence sequence (Robbins' mixture martingale; the "mixture SPRT" of
Johari, Pekelis & Walsh, *Always valid inference*, 2017, with a N(0, tau^2) mixing law)
bounds the true difference D at every look at once:

    |d - D| <= h(V) = sqrt( V (1 + V/tau^2) * log( (1 + tau^2/V) / alpha^2 ) ),  alpha = 1 - confidence

with probability at least 1 - alpha over the whole run, however many looks and whenever the
gate stops (exact for normal rewards of known variance; with the estimated variance and the
central limit theorem, asymptotically: Waudby-Smith et al., *Time-uniform central limit theory
and asymptotic confidence sequences*, 2021). The gate PROMOTES once d - h > -tolerance (the
data reject H0: D <= -tolerance) and ROLLS BACK once d + h < -tolerance (they reject
H0': D >= -tolerance). A promotion while D <= -tolerance and a rollback while D >= -tolerance
each need the sequence to miss D, so each happens with probability at most alpha (both
together too). Otherwise it WAITS. tau = tolerance makes the bound tightest where it is
compared with the tolerance (at about the variance where h equals the tolerance).
For the lower bound, the one that promotes, the canary's variance estimate is floored at the
stable version's (V = max(var_c, var_s)/n_c + var_s/n_s): from a few dozen rollouts it is noisy,
and with 0/1 rewards it is smallest exactly when the canary's mean is luckily high, which
without the floor let false promotions reach the full alpha (``bench.gate`` measured 5.0% at a
true difference of -tolerance with 20 minimum rollouts; 2.3% with it). Under H0 the versions are
close, and where the canary truly varies less the floor only slows promotion. The upper bound,
the one that rolls back, keeps the canary's own variance, so a canary that fails every rollout
is rolled back at the minimum count.
Rewards may be any finite numbers; nothing is clipped. With no spread at all (every reward of
both versions identical) V is 0 and the bound is the observed difference: the gate's minimum
canary rollouts are what keep a handful of equal rewards from deciding.

**Offline evaluation** (one look, the same tasks for both versions): the one-sided paired
Student-t bound on the mean per-task difference, lower = mean - t(n-1, confidence) * sd/sqrt(n);
a candidate passes only when lower > -tolerance.
"""

from __future__ import annotations

import math
from enum import StrEnum
from statistics import NormalDist
from typing import TypeVar

import numpy as np
import numpy.typing as npt

Values = TypeVar("Values", float, npt.NDArray[np.float64])
"""A float, or a numpy array of them: each function works element by element."""


class Verdict(StrEnum):
    """What the canary's numbers say at one look."""

    PROMOTE = "promote"
    ROLL_BACK = "roll back"
    WAIT = "wait"


def mixture_half_width(variance: Values, tolerance: float, confidence: float) -> Values:
    """h(V) of the module docstring: how far the observed difference may be from the true one, at every look."""
    if tolerance <= 0:
        raise ValueError("the mixture needs a tolerance > 0 (its scale)")
    alpha, tau2 = 1.0 - confidence, tolerance * tolerance
    v = np.asarray(variance, dtype=np.float64)
    safe = np.where(v > 0, v, 1.0)
    width = np.sqrt(safe * (1.0 + safe / tau2) * np.log((1.0 + tau2 / safe) / alpha ** 2))
    return _like(variance, np.where(v > 0, width, 0.0))


def canary_bounds(n_canary: Values, mean_canary: Values, var_canary: Values, n_stable: Values, mean_stable: Values,
                  var_stable: Values, *, tolerance: float, confidence: float) -> tuple[Values, Values, Values]:
    """The observed difference canary - stable and its always-valid lower and upper bounds.

    For the lower bound (the one that promotes) the canary's variance is floored at the stable
    version's; the upper bound (the one that rolls back) uses the canary's own (module docstring).
    """
    difference = mean_canary - mean_stable
    guarded = mixture_half_width(np.maximum(var_canary, var_stable) / n_canary + var_stable / n_stable, tolerance,
                                 confidence)
    own = mixture_half_width(var_canary / n_canary + var_stable / n_stable, tolerance, confidence)
    return difference, difference - guarded, difference + own


def canary_verdict(lower: float, upper: float, tolerance: float) -> Verdict:
    """Promote when even the lower bound is within the tolerance, roll back when even the upper bound is not."""
    if lower > -tolerance:
        return Verdict.PROMOTE
    if upper < -tolerance:
        return Verdict.ROLL_BACK
    return Verdict.WAIT


def t_quantile(confidence: float, degrees: Values) -> Values:
    """Student's t quantile, by the Cornish-Fisher expansion in 1/degrees (Abramowitz & Stegun 26.7.5).

    Within 1e-3 of the exact quantile from 5 degrees of freedom at 0.95; the normal quantile as
    degrees grow.
    """
    z = NormalDist().inv_cdf(confidence)
    nu = np.asarray(degrees, dtype=np.float64)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    return _like(degrees, z + g1 / nu + g2 / nu ** 2 + g3 / nu ** 3)


def paired_lower_bound(mean: Values, variance: Values, tasks: int, confidence: float) -> Values:
    """The one-sided lower confidence bound of the mean paired difference over ``tasks`` tasks (at least two)."""
    if tasks < 2:
        raise ValueError("a paired bound needs at least two tasks")
    return mean - t_quantile(confidence, float(tasks - 1)) * np.sqrt(variance / tasks)


def paired_differences(candidate: tuple[float, ...], reference: tuple[float, ...]) -> tuple[float, float]:
    """The mean and sample variance of candidate - reference, task by task."""
    differences = [c - r for c, r in zip(candidate, reference, strict=True)]
    mean = math.fsum(differences) / len(differences)
    variance = math.fsum((d - mean) ** 2 for d in differences) / max(1, len(differences) - 1)
    return mean, variance


def _like(template: Values, result: npt.NDArray[np.float64]) -> Values:
    """A float where the caller passed one, the array otherwise."""
    return result if isinstance(template, np.ndarray) else float(result)
