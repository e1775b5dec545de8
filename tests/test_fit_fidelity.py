"""Fidelity of the cheaper threshold fit (TacticConfig.segment_samples) on 128K-token ranked
lists, float64, CPU (scripts/fit_fidelity.py runs the full study: real SmolLM2 attention,
64K-128K calibrated synthetic decode steps)."""
import pytest
import torch

from kvsieve.config import TacticConfig
from kvsieve.eval.fit_fidelity import compare_lists, ranked_lists, summarise

L = 131072


def _check(full, other):
    """Fidelity criteria of a setting against the full-segment fit -> list of failures."""
    bad = []
    if abs(other["budget_ratio"] - 1) > 0.1:
        bad.append(f"total budget x{other['budget_ratio']:.3f}")
    if other["rel_budget_mean"] > 0.2:
        bad.append(f"budgets moved {other['rel_budget_mean']:.1%} per row")
    if other["mass_mean"] < full["mass_mean"] - 0.0075:
        bad.append(f"mass {other['mass_mean']:.4f} < {full['mass_mean']:.4f}")
    if other["err_mean"] > 1.05 * full["err_mean"] + 1e-3:
        bad.append(f"output error {other['err_mean']:.4f} > {full['err_mean']:.4f}")
    return bad


@pytest.mark.parametrize("spread,control", [(2.0, {"head_max_tokens": 512}), (3.0, {"segment_samples": 4})])
def test_sampled_segments_keep_budgets_mass_and_error_on_128k_lists(spread, control):
    """The default segment_samples scores 40% fewer positions at 128K and chooses budgets of
    the same mass and output error as reading the whole segments (budgets ~40% and ~8% of
    the list); a much cheaper fit (a head capped at 512 of 2,622 tokens, 4 samples per
    segment) fails the same check: it can fail."""
    default = TacticConfig().segment_samples
    assert 0 < default < 0.01 * L  # the segments really are sampled at 128K
    lists = ranked_lists(6, L, spread, seed=int(spread))
    full, new, cheap = summarise(compare_lists(lists, [("full", {"segment_samples": 0}), ("default", {}),
                                                       ("control", control)]))
    assert new["reads"] < 0.62 * full["reads"]
    assert _check(full, new) == [], _check(full, new)
    assert _check(full, cheap), cheap
