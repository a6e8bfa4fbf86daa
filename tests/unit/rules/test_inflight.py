"""The adaptive in-flight policy on synthetic step-time curves, and in a rollout."""

from __future__ import annotations

import asyncio
from typing import Any

from april_client.protocol import GroupSpec, RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.inflight import (
    MIN_RUNNING,
    NEW_TOKEN_RESERVE,
    Admission,
    ContextModel,
    EngineCapacity,
    StepCurve,
    StepStat,
    choose_running_target,
    kv_need,
)
from april_server.wire.ids import split_sample_id
from tests.unit.fake_engine import FakeEngine

SIZES = [1, 2, 4, 8, 16, 32]


def curve(fn: Any) -> StepCurve:
    return StepCurve({b: fn(b) for b in SIZES})


def test_flat_step_time_overprovisions_to_the_cap() -> None:
    # Memory-bound decode: a step costs the same at any batch size.
    d = choose_running_target(curve(lambda b: 0.01), demand=32, cap=64)
    assert d.running_target >= 0.95 * 64  # within EPS of the best: as good as all of it


def test_linear_cost_never_goes_beyond_the_quota() -> None:
    # Compute-bound: throughput is flat, extra concurrency only adds stale tokens.
    d = choose_running_target(curve(lambda b: 0.002 * b), demand=32, cap=64)
    assert d.running_target == 32


def test_saturating_curve_stops_at_the_knee() -> None:
    # t(b) = a + c b: throughput b / (a + c b) reaches 95 % of its best near 19 a / c = 19.
    d = choose_running_target(curve(lambda b: 0.019 + 0.001 * b), demand=8, cap=200)
    assert 8 < d.running_target < 64
    thr = StepCurve({b: 0.019 + 0.001 * b for b in SIZES}).throughput
    assert thr(d.running_target) >= 0.95 * max(thr(b) for b in range(1, 65))


def test_a_cold_policy_starts_at_twice_the_quota_never_everything() -> None:
    d = choose_running_target(StepCurve({}), demand=16, cap=100_000)
    assert d.running_target == 32 and "prior" in d.reason
    # Small quotas still get the floor, and nothing exceeds what the call has.
    assert choose_running_target(StepCurve({}), demand=1, cap=100).running_target == MIN_RUNNING
    assert choose_running_target(StepCurve({}), demand=1, cap=2).running_target == 2


def test_a_curve_saying_batch_1_beats_2_does_not_serialize_a_small_call() -> None:
    # The CI flake of issue #11: on a nearly idle tiny model one slow step at batch 2 made
    # "auto" start one group of a 2-group call, so nothing ran beside it.
    noisy = StepCurve.smoothed({1: 0.002, 2: 0.009, 3: 0.010})
    assert choose_running_target(noisy, demand=1, cap=2).running_target == 2
    assert choose_running_target(noisy, demand=1, cap=50).running_target >= MIN_RUNNING


def test_admission_bounds_samples_and_kv_tokens_plus_a_short_queue() -> None:
    adm = Admission()
    assert adm.fits(10**6, 1e12)  # capacity unknown: only the policy bounds a call
    adm.configure(EngineCapacity(max_running_requests=64, max_total_tokens=10_000))
    assert adm.max_samples == 64 + 16
    assert not adm.fits(81, 0.0) and adm.fits(80, 12_500.0)
    adm.take(70, 1000.0)
    assert adm.fits(10, 10.0) and not adm.fits(11, 10.0)  # 80 samples at most
    assert not adm.fits(1, 11_600.0)  # 12,500 tokens at most
    adm.give_back(70, 1000.0)
    assert adm.samples == 0 and adm.tokens == 0.0
    assert kv_need(100, 50) == 100 + NEW_TOKEN_RESERVE * 50


class CurveEngine(FakeEngine):
    def __init__(self, points: dict[int, float]) -> None:
        super().__init__(delay_s=0.001)
        self.points = points
        self.max_active = 0

    async def step_curve(self) -> dict[int, float]:
        return self.points

    async def generate(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> Any:
        self.max_active = max(self.max_active, len(self.active) + 1)
        return await super().generate(rid, input_ids, params)


def staggered_groups() -> list[GroupSpec]:
    """Ten groups of 2 whose budgets cycle 5, 25, 45 tokens."""
    return [
        GroupSpec(
            group_id=f"g{i}",
            n=2,
            input_ids=[1, 2],
            sampling_params={"ignore_eos": True, "max_new_tokens": 5 + 20 * (i % 3)},
        )
        for i in range(10)
    ]


def test_auto_refills_up_to_the_target_and_never_beyond_what_was_sent() -> None:
    async def go() -> None:
        eng = CurveEngine({b: 0.002 * b for b in SIZES})  # linear cost: the quota's demand,
        # raised to the floor of MIN_RUNNING samples
        mgr = RolloutManager(eng, Durable.open(None))
        groups = staggered_groups()
        r = await mgr.rollout(RolloutReq(groups=groups, target_groups=3))
        assert r.stats.inflight_target == MIN_RUNNING == 8  # demand 3 groups x 2 samples = 6
        assert eng.max_active <= 8
        assert 3 <= r.stats.peak_running_samples <= 8
        # A request id is "{sample_id}@{owner}...": the group is the sample id's.
        started = {(split_sample_id(c[0].split("@")[0]) or ("", -1))[0] for c in eng.calls}
        assert started <= {g.group_id for g in groups}
        assert r.stats.num_started_groups == len(started) < len(groups)
        assert len(r.groups) == 3
        mgr.check_integrity()

    asyncio.run(go())


def test_smoothing_removes_dips_and_keeps_monotone_curves() -> None:
    raw = {1: 0.01, 2: 0.012, 4: 0.30, 8: 0.02, 16: 0.03}
    fit = StepCurve.smoothed(raw).points
    assert list(fit) == [1, 2, 4, 8, 16]
    assert all(fit[a] <= fit[b] for a, b in zip([1, 2, 4, 8], [2, 4, 8, 16], strict=True))
    mono = {1: 0.01, 2: 0.02, 4: 0.03}
    assert StepCurve.smoothed(mono).points == mono


def test_one_noisy_top_step_does_not_stop_exploration() -> None:
    # Still-rising throughput measured at every size up to the quota's 32, the last step slowed
    # by noise (CPU contention): the policy must still look past 32, not settle at the quota.
    raw = {b: 0.004 + 0.0001 * b for b in range(1, 33)}
    raw[32] = 0.02
    d = choose_running_target(StepCurve.smoothed(raw), demand=32, cap=64)
    assert d.running_target > 40, d
    # A genuinely steep top (compute-bound from 16 on) still stops at the quota.
    steep = {
        b: 0.004 + (0.0001 * b if b <= 16 else 0.0016 + 0.002 * (b - 16)) for b in range(1, 33)
    }
    assert choose_running_target(StepCurve.smoothed(steep), demand=32, cap=64).running_target == 32


def test_a_thinly_measured_slow_top_is_tried_a_well_measured_one_is_not() -> None:
    # Throughput still rising up to the quota's 32 (measured hundreds of times); bigger sizes
    # seen only in a few slow steps (the burst at the start of one call) look worse than 32.
    low = {b: StepStat(300, 0.004 + 0.0002 * b, 0.003) for b in range(1, 33)}
    slow_top = {b: 0.02 for b in range(40, 61, 4)}
    thin = {**low, **{b: StepStat(3, t, 0.006) for b, t in slow_top.items()}}
    assert choose_running_target(StepCurve.smoothed(thin), demand=32, cap=64).running_target > 40
    # Once those sizes are measured as often and still slow, the quota's 32 is the knee.
    thick = {**low, **{b: StepStat(300, t, 0.006) for b, t in slow_top.items()}}
    assert choose_running_target(StepCurve.smoothed(thick), demand=32, cap=64).running_target == 32
    # Bare means (no spread known) are taken as they are.
    bare = {**{b: s.mean_s for b, s in low.items()}, **slow_top}
    assert choose_running_target(StepCurve.smoothed(bare), demand=32, cap=64).running_target == 32


def test_optimism_is_bounded_and_weights_pool_by_measurements() -> None:
    assert StepStat(1, 0.01, 0.5).optimistic() == 0.01  # one step: no spread to speak of
    assert StepStat(4, 0.01, 0.5).optimistic() == 0.005  # never below half the mean
    assert abs(StepStat(100, 0.01, 0.001).optimistic() - 0.0098) < 1e-12
    # A dip pooled with a heavily measured neighbour lands near that neighbour, not midway.
    fit = StepCurve.smoothed({8: StepStat(1000, 0.02, 0.0), 9: StepStat(2, 0.01, 0.0)}).points
    assert abs(fit[8] - fit[9]) < 1e-12 and abs(fit[8] - (1000 * 0.02 + 2 * 0.01) / 1002) < 1e-12


def measured(b: int, contexts: list[float], cost: Any) -> StepStat:
    """What the timer reports for `b` running samples over steps at these contexts."""
    times = [cost(b, c) for c in contexts]
    n, mt, mc = len(times), sum(times) / len(times), sum(contexts) / len(contexts)
    s_tc = sum((t - mt) * (c - mc) for t, c in zip(times, contexts, strict=True))
    s_cc = sum((c - mc) ** 2 for c in contexts)
    return StepStat(n, mt, 0.0, mc, s_tc, s_cc)


def test_context_model_recovers_the_per_token_cost_and_evens_out_contexts() -> None:
    def cost(b: int, ctx: float) -> float:
        return 0.004 + 0.0001 * b + 2e-6 * ctx

    # Every size steps over 120 tokens per sample on average, except 32, which was measured at
    # 40 tokens per sample (say a warm-up of short requests).
    stats = {b: measured(b, [b * 100.0, b * 120.0, b * 140.0], cost) for b in (8, 16, 24, 40)}
    stats[32] = measured(32, [32 * 30.0, 32 * 40.0, 32 * 50.0], cost)
    model = ContextModel.fit(stats)
    assert model is not None and abs(model.cost_per_token_s - 2e-6) < 1e-12
    per_sample = model.context_per_sample
    fit = StepCurve.smoothed(stats).points
    for b in stats:
        assert abs(fit[b] - cost(b, b * per_sample)) < 1e-9, b


def test_a_size_measured_at_short_contexts_does_not_pin_the_target() -> None:
    # Throughput still rising to 64 at the workload's context; 32 looks cheap only because
    # most of its steps were short-context ones. Taken at face value it would be the knee.
    def cost(b: int, ctx: float) -> float:
        return 0.004 + 0.00005 * b + 1.5e-6 * ctx

    stats = {b: measured(b, [b * 100.0, b * 130.0, b * 160.0], cost) for b in range(8, 65, 8)}
    stats[32] = measured(32, [32 * 20.0, 32 * 30.0, 32 * 40.0], cost)
    d = choose_running_target(StepCurve.smoothed(stats), demand=32, cap=64)
    assert d.running_target > 48, d
    blind = {b: m._replace(mean_context=0.0) for b, m in stats.items()}  # no context known
    assert choose_running_target(StepCurve.smoothed(blind), demand=32, cap=64).running_target < 40


def test_a_decision_fits_the_line_past_the_largest_size_once(monkeypatch: Any) -> None:
    # A decision asks for every size up to twice the largest measured; refitting the line for
    # each cost O(P^2) per size (27 s at 1024 measured sizes, on the event loop).
    from april_server.rules import inflight

    fits = []
    real_median = inflight.median
    monkeypatch.setattr(inflight, "median", lambda xs: fits.append(1) or real_median(xs))
    c = StepCurve.smoothed({b: StepStat(50, 0.01 + 0.00005 * b, 0.001) for b in range(1, 257)})
    d = choose_running_target(c, 128, 1 << 30)
    assert d.running_target > 256  # it looked past the largest measured size
    assert len(fits) == 2  # one slope, one intercept
