"""How many groups a call should hold (`stats.groups_wanted`): the pure play-forward, held to a
plain token-by-token reference, and its wiring into a call's stats."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from april_client.protocol import RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules import pool_size
from april_server.rules.inflight import StepCurve, choose_running_target
from april_server.rules.pool_size import (
    MAX_WANTED_PER_QUOTA,
    PUSH_MEMORY,
    PUSHED_PER_QUOTA,
    SMOOTHING_CALLS,
    PoolAdvisor,
    bound_per_quota,
    groups_wanted,
)
from tests.unit.rules.test_inflight import SIZES, CurveEngine, staggered_groups


def reference(
    quota: int, target: int, carried: list[list[float]], fresh: list[int], size: int
) -> int:
    """The same play, one decode step at a time: every running sample makes a token; those
    that reach their length end; then whole groups are admitted in order while they fit."""
    order = list(fresh)
    random.Random(len(order)).shuffle(order)
    k = 0

    def fresh_group() -> list[float]:
        nonlocal k
        group = [float(max(order[(k + j) % len(order)], 1)) for j in range(size)]
        k += size
        return group

    limit = max(MAX_WANTED_PER_QUOTA * quota, len(carried))
    queue = [list(g) for g in carried]
    running: list[tuple[float, int]] = []  # (tokens left, group)
    left: list[int] = []
    finished = 0

    def admit() -> None:
        nonlocal finished
        while finished < quota and len(left) < limit:
            if not queue:
                queue.append(fresh_group())
            if running and len(running) + len(queue[0]) > target:
                return
            members = queue.pop(0)
            left.append(len(members))
            finished += not members
            running.extend((max(m, 1.0), len(left) - 1) for m in members)

    admit()
    while finished < quota and running:
        running = [(t - 1, g) for t, g in running]
        for _, g in [r for r in running if r[0] <= 0]:
            left[g] -= 1
            finished += left[g] == 0
        running = [r for r in running if r[0] > 0]
        admit()
    return min(max(len(left), len(carried), quota), limit)


lengths = st.integers(min_value=1, max_value=60)


@settings(max_examples=150, deadline=None)
@given(
    quota=st.integers(1, 5),
    target=st.integers(1, 40),
    carried=st.lists(st.lists(lengths, max_size=4), max_size=6),
    fresh=st.lists(lengths, min_size=1, max_size=12),
    size=st.integers(1, 4),
)
def test_the_play_matches_a_token_by_token_reference(
    quota: int, target: int, carried: list[list[int]], fresh: list[int], size: int
) -> None:
    as_floats = [[float(x) for x in g] for g in carried]
    got = groups_wanted(quota, target, as_floats, fresh, size)
    assert got == reference(quota, target, as_floats, fresh, size)
    assert got is not None
    assert max(quota, len(carried)) <= got <= max(MAX_WANTED_PER_QUOTA * quota, len(carried))


def test_equal_lengths_want_exactly_what_fills_the_batch() -> None:
    # 32 running samples = 8 groups of 4; all end together, and 8 >= the quota of 4.
    assert groups_wanted(4, 32, [], [100], 4) == 8
    # A batch of the quota's own size wants no over-provisioning at all.
    assert groups_wanted(4, 16, [], [100], 4) == 4


def test_a_long_tail_wants_more_groups_than_its_batch_holds_at_once() -> None:
    # One member in four runs 20x longer: a group ends only when its longest member does, so
    # the batch keeps admitting fresh groups while the quota waits.
    wanted = groups_wanted(4, 32, [], [10, 10, 10, 200], 4)
    assert wanted is not None and wanted > 8


def test_carried_groups_start_first_and_all_count() -> None:
    # Two carried groups fill the batch and run long: the play starts nothing fresh before
    # one of them ends, so what the next call needs is what it carries.
    carried = [[1000.0] * 4, [1000.0] * 4]
    assert groups_wanted(1, 8, carried, [5], 4) == 2
    # A carried group with nothing left has finished: it counts toward the quota at once.
    assert groups_wanted(1, 8, [[]], [5], 4) == 1


def test_max_staleness_bounds_how_many_quotas_are_held() -> None:
    # s steps of carrying allow s + 1 quotas' worth: max_staleness 1 is slime's 2 x.
    assert [bound_per_quota(s) for s in (0, 1, 2, 10)] == [1, 2, 3, MAX_WANTED_PER_QUOTA]
    assert bound_per_quota(None) == MAX_WANTED_PER_QUOTA
    assert groups_wanted(2, 10_000, [], [1, 5000], 4, bound_per_quota(1)) == 4
    # What it carries is never advised away, whatever the bound.
    assert groups_wanted(1, 8, [[9.0]] * 5, [5], 4, bound_per_quota(0)) == 5


def test_a_push_between_calls_bounds_the_advice_at_slimes_two_quotas() -> None:
    # A huge running target and lengths that barely end want the most the bound allows.
    args = ([], [1, 5000], 4, None)
    advisor = PoolAdvisor()
    most, pushed = MAX_WANTED_PER_QUOTA * 2, PUSHED_PER_QUOTA * 2
    # The first: nothing to compare, so the cadence is unknown and bounded as under pushes.
    assert advisor.advise(2, 10_000, "v0", *args) == pushed
    assert advisor.advise(2, 10_000, "v0", *args) == most  # no push since
    assert advisor.advise(2, 10_000, "v1", *args) == pushed  # a push since
    # Remembered for PUSH_MEMORY pairs of calls: a trainer pushing every other step is not
    # advised 4 x just before its next push.
    for _ in range(PUSH_MEMORY - 1):
        assert advisor.advise(2, 10_000, "v1", *args) == pushed
    assert advisor.advise(2, 10_000, "v1", *args) == most
    # max_staleness bounds it further, pushes or not.
    assert bound_per_quota(0, pushed=True) == 1
    assert bound_per_quota(5, pushed=True) == PUSHED_PER_QUOTA


def test_the_advice_plays_at_the_median_of_the_recent_running_targets() -> None:
    # Equal lengths: the advice is what fills the batch, so it shows the target played at.
    advisor = PoolAdvisor()
    wanted = [advisor.advise(4, t, "v0", [], [100], 4, None) for t in (32, 16, 64, 16, 32)]
    # Medians of 32 | 32,16 | 32,16,64 | 32,16,64,16 | 32,16,64,16,32: one call's swing to 64
    # or 16 moves the pool no further than the calls around it agree.
    assert wanted == [8, 8, 8, 8, 8]
    assert len(advisor.targets[(4, 4)]) == SMOOTHING_CALLS
    # Another call shape between them keeps its own targets (its target of 8 is not mixed in).
    assert advisor.advise(2, 8, "v0", [], [100], 4, None) == 2
    for _ in range(SMOOTHING_CALLS // 2 + 1):  # a lasting change wins within a few calls
        last = advisor.advise(4, 16, "v0", [], [100], 4, None)
    assert last == 4


def test_no_lengths_seen_is_no_advice() -> None:
    assert groups_wanted(4, 32, [], [], 4) is None


def test_the_advice_is_bounded_by_the_quota() -> None:
    # A huge running target and lengths that barely end: never more than the bound.
    assert groups_wanted(2, 10_000, [], [1, 5000], 4) == MAX_WANTED_PER_QUOTA * 2


def test_a_call_reports_the_advice_from_its_curve_and_its_lengths(monkeypatch: Any) -> None:
    seen: list[tuple[Any, ...]] = []

    def recorded(*args: Any) -> int | None:
        seen.append(args)
        return groups_wanted(*args)

    monkeypatch.setattr(pool_size, "groups_wanted", recorded)

    def run(points: dict[int, float], pinned: int | None = None) -> int | None:
        seen.clear()

        async def go() -> int | None:
            mgr = RolloutManager(CurveEngine(points), Durable.open(None))
            # As after an earlier call with no push since: the 4 x bound applies.
            mgr.sizing.advisor.version = mgr.versions.now()
            req = RolloutReq(
                groups=staggered_groups(), target_groups=3, max_inflight_groups=pinned or "auto"
            )
            r = await mgr.rollout(req)
            if pinned:
                assert not seen  # a pinned batch: no play, no advice
                return r.stats.groups_wanted
            ((quota, target, carried, recent, size, per_quota),) = seen
            # The quota, the running target the curve picks with no cap from what was sent,
            # one entry per buffered group, every length seen to finish, the group size.
            assert (quota, size, per_quota) == (3, 2, MAX_WANTED_PER_QUOTA)  # no max_staleness
            uncapped = choose_running_target(StepCurve.smoothed(points), 3 * 2, 1 << 30)
            assert target == uncapped.running_target == (8 if points[32] > points[1] else 61)
            assert len(carried) == len(r.buffered_group_ids) > 0
            done = sum(s.status in ("completed", "truncated") for g in r.groups for s in g.samples)
            assert len(recent) >= done == 6
            assert r.stats.groups_wanted == groups_wanted(
                quota, target, carried, recent, size, per_quota
            )
            return r.stats.groups_wanted

        return asyncio.run(go())

    linear = run({b: 0.002 * b for b in SIZES})  # the knee: the floor of 8 samples
    flat = run({b: 0.01 for b in SIZES})  # throughput rises to the horizon (2 x 32)
    assert linear is not None and flat is not None and flat > linear
    assert run({b: 0.01 for b in SIZES}, pinned=4) is None
