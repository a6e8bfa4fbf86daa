"""The staleness ceiling (`staleness_ceiling.py`): what a trainer's bound on staleness leaves of
the engine's bound, from the bound's levels and the workload's lengths."""

from __future__ import annotations

import pytest

from april_bench.staleness_ceiling import StepCost, ceiling_line, for_run, staleness_ceiling
from april_bench.workload import Workload

FIXED_S, PER_TOKEN_S = 1e-3, 1e-4  # an engine whose decode step costs 1 ms + 0.1 ms a sample


def level(batch: float, fixed_s: float = FIXED_S) -> dict[str, float]:
    return {
        "concurrency": batch,
        "mean_batch": batch,
        "tok_s": batch / (fixed_s + PER_TOKEN_S * batch),
    }


LEVELS = [level(b) for b in (8, 16, 32, 64)]
BEST_TOK_S = LEVELS[-1]["tok_s"]


def test_the_step_cost_is_the_lower_hull_of_the_levels() -> None:
    cost = StepCost.fit(LEVELS)
    assert cost is not None
    for b in (4, 8, 20, 64, 100):  # on the line, between and beyond the levels
        assert cost.at(b) == pytest.approx(FIXED_S + PER_TOKEN_S * b)
    slow_16 = [*LEVELS, level(16, fixed_s=3e-3)]  # a slow window at 16 is not the engine's cost
    cost = StepCost.fit(slow_16)
    assert cost is not None and cost.at(16) == pytest.approx(FIXED_S + PER_TOKEN_S * 16)
    assert StepCost.fit(LEVELS[:1]) is None


def test_equal_lengths_at_staleness_0_run_the_quota_as_one_batch() -> None:
    """Every sample as long as the others: a synchronous step runs the quota's Q samples for L
    decode steps, at the engine's rate at batch Q."""
    ceiling = staleness_ceiling(LEVELS, [100] * 320, quota_samples=32, max_staleness=0)
    assert ceiling is not None
    assert ceiling.step_decodes == pytest.approx(100)
    assert ceiling.mean_batch == pytest.approx(32)
    assert ceiling.tok_s == pytest.approx(32 / (FIXED_S + PER_TOKEN_S * 32))
    assert ceiling.thrown_share == 0


def test_one_long_sample_a_step_sets_its_length_and_staleness_stretches_it() -> None:
    """One sample of 400 among 31 of 10 in every step: at staleness s the steps are at least
    400 / (s + 1) decode steps, so a looser bound runs a bigger batch, up to the bound."""
    lengths = ([400] + [10] * 31) * 20
    shares = []
    for s in (0, 1, 3, 100):
        ceiling = staleness_ceiling(LEVELS, lengths, 32, s, thrown_max=0.0)
        assert ceiling is not None
        assert ceiling.longest_mean == 400
        tokens = 400 + 31 * 10
        decodes = max(400 / (s + 1), tokens / 64)
        assert ceiling.step_decodes == pytest.approx(decodes)
        expected = min(BEST_TOK_S, tokens / (decodes * (FIXED_S + PER_TOKEN_S * tokens / decodes)))
        assert ceiling.tok_s == pytest.approx(expected)
        shares.append(ceiling.share_of_bound)
    assert shares == sorted(shares) and shares[-1] == pytest.approx(1.0)


def test_throwing_the_longest_away_is_weighed_within_its_share() -> None:
    """One sample of 1000 among 3,199 of 10: cut at 10 it throws away the 10 tokens it made,
    0.03 % of what is generated, and its step's longest falls 100 x."""
    lengths = [10] * 32 * 99 + [1000] + [10] * 31
    kept = staleness_ceiling(LEVELS, lengths, 32, 0, thrown_max=0.0)
    cut = staleness_ceiling(LEVELS, lengths, 32, 0, thrown_max=0.05)
    assert kept is not None and cut is not None
    assert kept.cut == 1000 and kept.thrown_share == 0
    assert cut.cut == 10 and 0 < cut.thrown_share <= 0.05
    assert cut.tok_s > kept.tok_s


def test_it_needs_a_bound_a_step_of_lengths_and_a_pushing_trainer() -> None:
    assert staleness_ceiling(LEVELS[:1], [10] * 64, 32, 1) is None
    assert staleness_ceiling(LEVELS, [10] * 31, 32, 1) is None
    wl = Workload("longtail", 4, 512)
    assert for_run(LEVELS, wl, 32, 1, pushes=True) is not None
    assert for_run(LEVELS, wl, 32, None, pushes=True) is None  # no bound on staleness
    assert for_run(LEVELS, wl, 32, 1, pushes=False) is None  # nothing goes stale
    assert for_run(None, wl, 32, 1, pushes=True) is None


def test_the_line_says_what_it_assumes_and_what_it_found() -> None:
    lengths = ([400] + [10] * 31) * 4
    kept = staleness_ceiling(LEVELS, lengths, 32, 1, thrown_max=0.0)
    assert kept is not None
    line = ceiling_line(kept.to_json())
    assert "within max_staleness 1" in line and "lengths unknown until they end" in line
    assert "longest sample averages 400 tokens" in line and "none thrown away" in line
    cut = staleness_ceiling(LEVELS, lengths, 32, 1)
    assert cut is not None
    assert "samples longer than 10 thrown away, 3.1% of generated" in ceiling_line(cut.to_json())


def test_a_level_without_a_batch_is_left_out_of_the_cost_and_the_best() -> None:
    """A window with no decode step has no batch: the ceiling comes from the others."""
    no_batch = {"concurrency": 128, "mean_batch": None, "tok_s": 2 * BEST_TOK_S}
    ceiling = staleness_ceiling([*LEVELS, no_batch], [100] * 320, 32, 0)
    assert ceiling is not None
    assert ceiling.tok_s == pytest.approx(32 / (FIXED_S + PER_TOKEN_S * 32))
    assert ceiling.share_of_bound == pytest.approx(ceiling.tok_s / BEST_TOK_S)
