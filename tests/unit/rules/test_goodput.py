"""The pool that maximises fresh tokens (`goodput.py`): the censored length fit, the played
calls (sync at no extra group, nothing thrown without a bound, nothing ages without pushes),
and the choice (never expected below sync nor to throw away more than its cap; a bound makes
it hold fewer)."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from april_server.rules.goodput import (
    GOODPUT_EPS,
    MIN_EXACT,
    THROWN_MAX,
    CallShape,
    LengthCensus,
    LengthFit,
    candidates,
    choose,
    play,
    play_sync,
)

lengths_st = st.lists(st.integers(1, 400), min_size=MIN_EXACT, max_size=60)


def long_tail(count: int = 400, top: int = 512, seed: int = 0) -> list[int]:
    """The bench's reference workload: lognormal, median 0.15 x top, p99 at top."""
    rng = random.Random(seed)
    mu, sigma = math.log(0.15 * top), math.log(1 / 0.15) / 2.326
    return [min(top, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


def linear(b: int) -> float:
    """A small model on a CPU: a fixed cost per step plus one per running sample."""
    return 0.0012 + 0.000115 * b


def shape(m: int | None = None, pushes: bool = True, target: int = 64) -> CallShape:
    return CallShape(8, 4, target, m, pushes, prefill_s_per_token=2e-6, prompt_tokens=40)


def test_finished_lengths_alone_fit_their_empirical_distribution() -> None:
    fit = LengthFit.fit([10, 20, 30, 40, 50, 60, 70, 80], [])
    assert fit is not None and fit.censored == 0
    assert fit.quantile(0.5) == 40 and fit.quantile(0.99) == 80 and fit.quantile(0.01) == 10
    assert fit.mean == 45
    assert LengthFit.fit([10] * (MIN_EXACT - 1), [500]) is None  # too little evidence


def test_cut_samples_carry_the_tail_the_finished_ones_cannot_show() -> None:
    short = [10, 12, 14, 16, 18, 20, 22, 24]
    alone = LengthFit.fit(short, [])
    cut = LengthFit.fit(short, [30] * 8, tail=512)  # half of them still running past 30
    assert alone is not None and cut is not None
    assert cut.quantile(0.75) == 512  # longer than anything seen to finish: the budget
    assert cut.mean > 2 * alone.mean


@settings(max_examples=60, deadline=None)
@given(exact=lengths_st, cut=st.lists(st.integers(1, 400), max_size=30), extra=st.integers(1, 400))
def test_one_more_cut_sample_never_shortens_the_fit(
    exact: list[int], cut: list[int], extra: int
) -> None:
    before = LengthFit.fit(exact, cut, tail=400)
    after = LengthFit.fit(exact, [*cut, extra], tail=400)
    assert before is not None and after is not None
    assert list(before.values) == sorted(before.values) and before.cum[-1] == 1.0
    assert all(a <= b for a, b in zip(before.cum, before.cum[1:], strict=False))
    for q in (0.1, 0.25, 0.5, 0.75, 0.9, 0.99):
        assert after.quantile(q) >= before.quantile(q)


def test_draws_are_deterministic_and_follow_the_fit() -> None:
    fit = LengthFit.fit(long_tail(), [])
    assert fit is not None
    a, b = fit.draws(), fit.draws()
    assert a == b and len(a) == 512
    assert sorted(a)[255] <= fit.quantile(0.5) <= sorted(a)[256]


def test_no_extra_group_is_the_synchronous_trainer() -> None:
    lengths = long_tail()
    for m in (None, 1):
        p = play(linear, lengths, shape(m), 0)
        assert p.carried == 0 and p.thrown_share == 0.0
    sync = play_sync(linear, lengths, shape(1))
    assert sync.extra == 0 and sync.thrown_share == 0.0


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, extra=st.integers(0, 16), target=st.integers(4, 80))
def test_without_a_bound_nothing_is_thrown_and_at_most_extra_groups_carry(
    lengths: list[int], extra: int, target: int
) -> None:
    p = play(linear, lengths, shape(None, target=target), extra)
    assert p.thrown_share == 0.0 and p.carried <= extra
    assert p.goodput == p.throughput > 0


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, extra=st.integers(0, 16), m=st.integers(0, 2))
def test_without_pushes_nothing_ages(lengths: list[int], extra: int, m: int) -> None:
    p = play(linear, lengths, shape(m, pushes=False), extra)
    assert p.thrown_share == 0.0 and p.goodput == p.throughput


def test_a_staleness_bound_throws_the_tail_of_a_big_pool_away() -> None:
    lengths = long_tail()
    small, big = play(linear, lengths, shape(1), 2), play(linear, lengths, shape(1), 16)
    assert big.throughput > small.throughput  # the bigger pool fills the engine ...
    assert big.thrown_share > 0.3 > small.thrown_share  # ... and ages out
    assert big.goodput < small.goodput


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, m=st.one_of(st.none(), st.integers(0, 3)), most=st.integers(0, 24))
def test_the_choice_never_expects_less_than_sync_nor_to_throw_more_than_the_cap(
    lengths: list[int], m: int | None, most: int
) -> None:
    fit = LengthFit.fit(lengths, [])
    assert fit is not None
    choice = choose(linear, fit, shape(m), most)
    assert 0 <= choice.extra <= most
    assert choice.expected.goodput >= choice.sync.goodput
    assert choice.expected.thrown_share <= THROWN_MAX
    plays = [play(linear, fit.draws(), shape(m), e) for e in candidates(8, most)]
    best = max(p.goodput for p in plays if p.thrown_share <= THROWN_MAX)
    assert choice.expected.goodput >= (1 - GOODPUT_EPS) * best


def test_the_bound_decides_how_many_groups_stay_in_progress() -> None:
    fit = LengthFit.fit(long_tail(), [])
    assert fit is not None
    free, tight = choose(linear, fit, shape(None), 24), choose(linear, fit, shape(1), 24)
    assert free.extra == 24  # every group in progress adds throughput and nothing ages out
    # At the knee (64) or running every sample in progress: the smaller, if within 2 %.
    assert free.running_target in (64, (8 + 24) * 4)
    assert 0 < tight.extra <= 4  # a little over-provisioning, not the tail's worth
    assert tight.expected.goodput > 1.1 * tight.sync.goodput
    assert "max_staleness 1" in tight.reason and "sync" in tight.reason


def test_a_pool_that_throws_much_away_is_not_chosen_for_its_goodput() -> None:
    """On an engine far from saturation (a step costs the same at any batch), 24 extra groups
    under max_staleness 1 play the best goodput while throwing away over half of what they
    generate: the cap keeps the choice to the pools that throw away at most 5 %."""
    fit = LengthFit.fit(long_tail(), [])
    assert fit is not None
    flat = choose(lambda b: 0.01, fit, shape(1), 24)
    widest = play(lambda b: 0.01, fit.draws(), shape(1), 24)
    assert widest.goodput > flat.expected.goodput and widest.thrown_share > 0.5
    assert 0 < flat.extra < 24 and flat.expected.thrown_share <= THROWN_MAX
    assert flat.expected.goodput > 1.2 * flat.sync.goodput


def test_a_saturated_engine_gets_no_over_provisioning() -> None:
    fit = LengthFit.fit(long_tail(), [])
    assert fit is not None
    saturated = choose(lambda b: 0.001 * b, fit, shape(None), 24)  # tokens/s flat in b
    assert saturated.extra == 0


def test_candidates_start_at_sync_and_end_at_the_most() -> None:
    assert candidates(8, 24) == [0, 1, 2, 4, 6, 8, 12, 16, 24]
    assert candidates(8, 0) == [0]
    assert candidates(2, 3) == [0, 1, 2, 3]


def test_the_census_keeps_finished_lengths_exact_and_the_rest_cut() -> None:
    census = LengthCensus(size=4)
    census.record("a/0", 30, False, 100, 10)
    census.record("a/0", 20, False, 100, 10)  # restarted: at least as long as it got
    assert census.seen["a/0"] == (30, False)
    census.record("a/0", 55, True, 100, 10)
    assert census.seen["a/0"] == (55, True)
    census.record("b/0", 0, False, 300, 30)  # never started: no evidence
    assert "b/0" not in census.seen
    for i in range(5):
        census.record(f"c/{i}", 5, True, 100, 20)
    assert len(census.seen) == 4 and "a/0" not in census.seen  # the newest kept
    assert census.longest_budget == 100 and census.prompt_tokens > 10
    assert census.fit() is None  # 4 < MIN_EXACT
    census.forget()
    assert not census.seen and census.longest_budget == 0
