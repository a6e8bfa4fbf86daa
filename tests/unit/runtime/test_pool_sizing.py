"""The goodput pool in a call (`pool_sizing.py`): no evidence, no extra bound (none beyond the
quota under a `max_staleness`); with lengths
seen, an "auto" call keeps at most its quota plus the chosen extra groups in progress, reports
what its play expected beside a synchronous trainer's and what it got, and advises that pool;
the tokens it got count only those within its `max_staleness`."""

from __future__ import annotations

import asyncio

from april_client.protocol import Group, GroupSpec, RolloutReq, Sample, Segment
from april_server.engine.versions import WeightVersions
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.inflight import Admission
from april_server.rules.lengths import LengthModel
from april_server.runtime.pool_sizing import PoolSizing
from tests.unit.fake_engine import FakeEngine
from tests.unit.rules.test_inflight import SIZES, CurveEngine


def groups(prefix: str, count: int) -> list[GroupSpec]:
    """Groups of 2 whose budgets cycle 5, 25, 45, 85 tokens: a tail."""
    return [
        GroupSpec(
            group_id=f"{prefix}{i}",
            n=2,
            input_ids=[1, 2, 3],
            sampling_params={"ignore_eos": True, "max_new_tokens": (5, 25, 45, 85)[i % 4]},
        )
        for i in range(count)
    ]


def test_an_auto_call_keeps_its_quota_and_the_chosen_extra_in_progress() -> None:
    async def go() -> None:
        eng = CurveEngine({b: 0.001 + 0.0001 * b for b in SIZES})
        mgr = RolloutManager(eng, Durable.open(None))
        first = await mgr.rollout(RolloutReq(groups=groups("a", 8), target_groups=3))
        assert first.stats.extra_groups is None  # no length evidence yet: as it holds
        assert first.stats.goodput_expected_tok_s is None
        assert first.stats.goodput_tok_s is not None  # what it got is measured regardless
        for step in range(4):
            eng.version = str(step + 1)  # a push between calls
            sent = 8 - len(mgr.buffer.idle)
            req = RolloutReq(
                groups=groups(f"s{step}-", max(sent, 0)), target_groups=3, max_staleness=1
            )
            r = await mgr.rollout(req)
            st = r.stats
            assert st.extra_groups is not None and st.extra_groups >= 0
            # Started: the quota's 3 and at most the extra ones beyond it (a group that
            # finished at the same step as the quota's last one may be one more).
            assert st.num_started_groups <= 3 + st.extra_groups + 1
            assert st.goodput_expected_tok_s is not None and st.goodput_sync_tok_s is not None
            assert st.goodput_expected_tok_s >= st.goodput_sync_tok_s
            assert st.groups_wanted == max(3 + st.extra_groups, st.num_buffered_groups)
            assert len(r.groups) == 3
        policy = (await mgr.stats())["inflight_policy"]
        assert policy["last_target"] == st.inflight_target and "goodput" in policy["reason"]
        assert policy["extra_groups"] == st.extra_groups
        assert policy["goodput"]["expected_tok_s"] == st.goodput_expected_tok_s
        assert "max_staleness 1" in policy["goodput"]["reason"]
        assert policy["goodput_measured_calls"] == 5 and policy["goodput_measured_tok_s"] > 0
        assert policy["length_fit"]["finished"] >= 8 and policy["length_fit"]["p99"] <= 85

    asyncio.run(go())


def test_under_a_bound_a_call_before_any_length_evidence_carries_nothing_over() -> None:
    """No play without lengths: under max_staleness, the first call keeps only its quota's
    groups in progress (what it would carry over could only age), and its own finished
    samples give the next call a play; its advice is not the quota alone."""

    async def go() -> None:
        eng = CurveEngine({b: 0.001 + 0.0001 * b for b in SIZES})
        mgr = RolloutManager(eng, Durable.open(None))
        req = RolloutReq(groups=groups("a", 8), target_groups=4, max_staleness=1)
        st = (await mgr.rollout(req)).stats  # its quota: 8 samples, what a fit needs
        assert st.extra_groups == 0 and st.goodput_expected_tok_s is None
        assert st.num_started_groups == 4 and st.num_buffered_groups == 4
        assert all(e.output_tokens == 0 for e in mgr.buffer.idle.oldest())  # never started
        assert "until 8 samples have finished" in (await mgr.stats())["inflight_policy"]["reason"]
        assert st.groups_wanted is not None and st.groups_wanted > 4
        eng.version = "1"
        nxt = await mgr.rollout(RolloutReq(groups=[], target_groups=3, max_staleness=1))
        assert nxt.stats.goodput_expected_tok_s is not None

    asyncio.run(go())


def test_before_evidence_only_single_turn_calls_under_a_bound_run_no_extra_group() -> None:
    """Agent episodes' lengths are not counted (their tools' as much as theirs): a call of
    them would wait for evidence that never comes, so it runs what it holds, as a call
    without a bound does. The census is the one the weight cut records cut samples in."""

    async def go() -> None:
        eng = CurveEngine({b: 0.001 + 0.0001 * b for b in SIZES})
        mgr = RolloutManager(eng, Durable.open(None))
        assert mgr.weight_cut.census is mgr.sizing.census
        sizing = mgr.sizing
        for bound, single_turn, extra in ((1, True, 0), (1, False, None), (None, True, None)):
            pool = await sizing.decide(8, 16, 4, 2, bound, single_turn)
            assert pool.extra_groups == extra and pool.goodput is None

    asyncio.run(go())


def test_a_pinned_call_gets_no_goodput_pool() -> None:
    async def go() -> None:
        eng = CurveEngine({b: 0.001 + 0.0001 * b for b in SIZES})
        mgr = RolloutManager(eng, Durable.open(None))
        for step in range(3):
            req = RolloutReq(groups=groups(f"p{step}-", 6), target_groups=3, max_inflight_groups=4)
            st = (await mgr.rollout(req)).stats
            assert st.extra_groups is None and st.goodput_tok_s is None
            assert st.goodput_expected_tok_s is None

    asyncio.run(go())


def sample(segments: list[tuple[int, int, str]]) -> Sample:
    out = [7] * segments[-1][1]
    return Sample(
        sample_id="g/0",
        group_id="g",
        index=0,
        status="completed",
        prompt_ids=[1],
        output_ids=out,
        output_logprobs=[0.0] * len(out),
        segments=[Segment(start=a, end=b, weight_version=v, kv="fresh") for a, b, v in segments],
        max_new_tokens=len(out),
        finish_reason="length",
    )


def test_what_a_call_got_counts_only_tokens_within_its_bound() -> None:
    eng = FakeEngine()
    versions = WeightVersions(eng)
    for v in ("0", "1", "2"):
        eng.version = v
        versions.now()
    sizing = PoolSizing(eng, Admission(), LengthModel(), versions)
    g = Group(group_id="g", samples=[sample([(0, 10, "0"), (10, 25, "1"), (25, 30, "2")])])
    auto = RolloutReq(groups=[], target_groups=1, max_staleness=1)
    assert sizing.observe(auto, [g], [g], 2.0) == 20  # 15 + 5: version 0 is 2 behind
    assert sizing.observe(RolloutReq(groups=[], target_groups=1), [g], [g], 2.0) == 30
    assert sizing.observe(auto, [g], None, 2.0) is None  # not delivered: nothing got
    assert sizing.got[-1] == (30, 2.0)
    assert sizing.census.seen["g/0"] == (30, True)
