"""The always-valid (sequential) bound the gate judges canaries with."""

from __future__ import annotations

import pytest

from agentstream.deploy.sequential import mixture_half_width, t_quantile


def test_the_bound_is_valid_at_every_look_where_a_fixed_test_is_not():
    """Looked at after every canary rollout up to 2,000, at a true difference of exactly -tolerance."""
    from tests.support.gate_simulation import simulate_canaries

    sequential = simulate_canaries(difference=-0.05, canaries=400, horizon=2000, seed=1)
    assert sequential.promoted <= 0.05 * 400 + 8  # at most alpha, with room for the sampling noise of 400 runs
    naive = simulate_canaries(difference=-0.05, canaries=400, horizon=2000, seed=1, rule="fixed")
    assert naive.promoted > 0.15 * 400  # the fixed one-sided test re-run at each look promotes far more often


def test_the_mixture_bound_shrinks_with_the_variance_and_grows_with_the_confidence():
    widths = [mixture_half_width(v, 0.05, 0.95) for v in (1e-2, 1e-3, 1e-4, 1e-5)]
    assert widths == sorted(widths, reverse=True) and mixture_half_width(0.0, 0.05, 0.95) == 0.0
    assert mixture_half_width(1e-3, 0.05, 0.99) > mixture_half_width(1e-3, 0.05, 0.95)
    assert t_quantile(0.95, 31.0) == pytest.approx(1.6955, abs=1e-3)
    assert t_quantile(0.95, 5.0) == pytest.approx(2.0150, abs=2e-3)
    with pytest.raises(ValueError, match="tolerance > 0"):
        mixture_half_width(1e-3, 0.0, 0.95)
