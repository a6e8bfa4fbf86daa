"""A call's quota and buffer bookkeeping against a fake engine (no SGLang): what it answers,
what it buffers and serves first, what a later call continues (abort and `/resume`:
`tests/unit/operations/`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_client.protocol import GroupSpec, RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import FakeEngine, next_token
from tests.unit.idle import idle_bodies


def make(tmp: Path | None = None, **kw: Any) -> RolloutManager:
    return RolloutManager(FakeEngine(**kw), Durable.open(tmp))


def spec(gid: str, n: int, budgets: list[int], prompt: list[int] | None = None) -> GroupSpec:
    return GroupSpec(
        group_id=gid,
        n=n,
        input_ids=prompt or [1, 5, 9],
        sampling_params={"temperature": 0.0, "ignore_eos": True},
        member_params=[{"max_new_tokens": b} for b in budgets],
    )


def reference(prompt: list[int], budget: int, vocab: int = 64) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(budget):
        t = next_token(ctx, vocab)
        out.append(t)
        ctx.append(t)
    return out


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _assert_quota_respected(resp: Any, target: int) -> None:
    assert len(resp.groups) == target
    for g in resp.groups:
        assert all(s.status in ("completed", "truncated") for s in g.samples)


HEAVY = [[4, 4, 4, 4], [4, 4, 6, 4], [8, 4, 4, 4], [4, 4, 4, 5]] + [[4, 200, 4, 4]] * 4


def test_quota_buffer_and_resume_first() -> None:
    async def go() -> None:
        mgr = make()
        groups = [spec(f"g{i}", 4, HEAVY[i]) for i in range(8)]
        r1 = await mgr.rollout(RolloutReq(groups=groups, target_groups=4, on_quota="tokens"))
        _assert_quota_respected(r1, 4)
        assert {g.group_id for g in r1.groups} == {"g0", "g1", "g2", "g3"}
        assert sorted(r1.buffered_group_ids) == ["g4", "g5", "g6", "g7"]
        assert not mgr.engine.active  # type: ignore[attr-defined]
        mgr.check_integrity()
        for g in idle_bodies(mgr.buffer):
            done = [s for s in g.samples if s.status == "truncated"]
            assert len(done) == 3  # finished members keep their outputs
            straggler = g.samples[1]
            assert straggler.status == "partial" and 0 < len(straggler.output_ids) < 200
        # The next call, with no new groups, finishes the buffered ones first.
        r2 = await mgr.rollout(RolloutReq(groups=[], target_groups=4))
        _assert_quota_respected(r2, 4)
        for g in r2.groups:
            for s, b in zip(g.samples, HEAVY[4], strict=True):
                assert len(s.output_ids) == b
                assert s.output_ids == reference(s.prompt_ids, b)
                assert len(s.output_logprobs) == b
        assert r2.stats.resumed_samples == 4
        assert idle_bodies(mgr.buffer) == []
        mgr.check_integrity()

    run(go())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budgets=st.lists(st.integers(1, 40), min_size=3, max_size=6),
    target=st.integers(1, 2),
    delay=st.sampled_from([0.0, 0.0005]),
)
def test_interrupt_and_resume_equals_uninterrupted(
    budgets: list[int], target: int, delay: float
) -> None:
    async def go() -> None:
        mgr = make(delay_s=delay)
        groups = [spec(f"g{i}", 1, [b], prompt=[i + 1, 3]) for i, b in enumerate(budgets)]
        resp = await mgr.rollout(RolloutReq(groups=groups, target_groups=target))
        got = {g.group_id: g for g in resp.groups}
        while idle_bodies(mgr.buffer):
            more = await mgr.rollout(RolloutReq(target_groups=len(idle_bodies(mgr.buffer))))
            got.update({g.group_id: g for g in more.groups})
            mgr.check_integrity()
        assert len(got) == len(budgets)
        for i, b in enumerate(budgets):
            s = got[f"g{i}"].samples[0]
            assert s.output_ids == reference([i + 1, 3], b)
            assert sum(seg.end - seg.start for seg in s.segments) == b

    run(go())


def test_surplus_finished_groups_are_buffered_and_served_first() -> None:
    async def go() -> None:
        mgr = make(delay_s=0.0)
        groups = [spec(f"g{i}", 2, [3, 3]) for i in range(3)]
        r1 = await mgr.rollout(RolloutReq(groups=groups, target_groups=1))
        assert len(r1.groups) == 1
        # the other two may have finished too (same budgets); whatever was not returned is kept
        r2 = await mgr.rollout(RolloutReq(groups=[spec("new", 1, [50])], target_groups=2))
        assert [g.group_id for g in r2.groups] == [g for g in r1.buffered_group_ids][:2]
        assert [g.group_id for g in idle_bodies(mgr.buffer)] == ["new"]

    run(go())


def test_drop_discards_started_stragglers_only() -> None:
    async def go() -> None:
        mgr = make()
        groups = [spec("fast", 1, [2]), spec("slow", 1, [300])]
        r = await mgr.rollout(RolloutReq(groups=groups, target_groups=1, on_quota="drop"))
        assert [g.group_id for g in r.groups] == ["fast"]
        assert r.stats.num_dropped_groups == 1 and idle_bodies(mgr.buffer) == []

    run(go())


def test_request_id_is_idempotent() -> None:
    async def go() -> None:
        mgr = make()
        req = RolloutReq(groups=[spec("a", 1, [3])], target_groups=1, request_id="step-1")
        r1 = await mgr.rollout(req)
        r2 = await mgr.rollout(req)
        assert r1 == r2
        assert len(mgr.engine.calls) == 1  # type: ignore[attr-defined]

    run(go())


def test_staleness_restarts_from_prompt() -> None:
    async def go() -> None:
        mgr = make()
        groups = [spec("a", 1, [2]), spec("b", 1, [300])]
        await mgr.rollout(RolloutReq(groups=groups, target_groups=1))
        assert (await mgr.buffer.read_samples(["b/0"]))["b/0"].output_ids
        mgr.engine.version = "2"  # type: ignore[attr-defined]
        r = await mgr.rollout(RolloutReq(target_groups=1, max_staleness=1))
        s = r.groups[0].samples[0]
        assert [seg.weight_version for seg in s.segments] == ["2"]
        assert s.output_ids == reference(s.prompt_ids, 300)
        assert s.staleness_restarts == 1  # the sample says so too (a call's restart)
        assert r.groups[0].samples[0].staleness_restarts == 1

    run(go())


def test_offpolicy_tokens_counted() -> None:
    async def go() -> None:
        mgr = make()
        await mgr.rollout(RolloutReq(groups=[spec("a", 1, [2]), spec("b", 1, [300])]))
        old = len((await mgr.buffer.read_samples(["b/0"]))["b/0"].output_ids)
        mgr.engine.version = "1"  # type: ignore[attr-defined]
        r = await mgr.rollout(RolloutReq(target_groups=1))
        assert r.stats.offpolicy_tokens == old
        assert [seg.weight_version for seg in r.groups[0].samples[0].segments] == ["0", "1"]

    run(go())


def test_durable_buffer_survives_restart(tmp_path: Path) -> None:
    db = tmp_path / "state" / "buffer.sqlite"

    async def first() -> list[Any]:
        mgr = make(db)
        await mgr.rollout(RolloutReq(groups=[spec("a", 1, [2]), spec("b", 2, [300, 2])]))
        return idle_bodies(mgr.buffer)

    before = run(first())
    mgr2 = make(db)
    assert idle_bodies(mgr2.buffer) == before
    r = run(mgr2.rollout(RolloutReq(target_groups=1)))
    assert len(r.groups[0].samples[0].output_ids) == 300


def test_engine_error_keeps_the_sample() -> None:
    async def go() -> None:
        mgr = make()
        mgr.engine.fail_rids.add("bad/0")  # type: ignore[attr-defined]
        r = await mgr.rollout(RolloutReq(groups=[spec("ok", 1, [2]), spec("bad", 1, [2])]))
        assert [g.group_id for g in r.groups] == ["ok"]
        assert (await mgr.buffer.read_group("bad")).samples[0].status == "partial"

    run(go())


@pytest.mark.parametrize(
    ("req", "status", "code"),
    [
        (RolloutReq(groups=[GroupSpec("a", n=0, input_ids=[1])]), 400, "invalid_n"),
        (RolloutReq(groups=[GroupSpec("a", input_ids=[])]), 400, "empty_prompt"),
        (RolloutReq(groups=[GroupSpec("a")]), 400, "invalid_prompt"),
        (
            RolloutReq(
                groups=[GroupSpec("a", input_ids=[1], sampling_params={"max_new_tokens": -1})]
            ),
            400,
            "invalid_budget",
        ),
        (
            RolloutReq(
                groups=[GroupSpec("a", input_ids=[1], sampling_params={"max_new_tokens": 999})]
            ),
            400,
            "context_overflow",
        ),
        (
            RolloutReq(groups=[GroupSpec("a", input_ids=[1])], target_groups=2),
            400,
            "invalid_target",
        ),
        (
            RolloutReq(groups=[GroupSpec("a", input_ids=[1]), GroupSpec("a", input_ids=[1])]),
            400,
            "duplicate_group_id",
        ),
        (RolloutReq(groups=[GroupSpec("a", input_ids=[1000])]), 400, "invalid_token"),
        (
            RolloutReq(groups=[GroupSpec("a", input_ids=[1], sampling_params={"bogus": 1})]),
            400,
            "invalid_sampling_params",
        ),
    ],
)
def test_bad_rollouts_are_rejected_before_anything_starts(
    req: RolloutReq, status: int, code: str
) -> None:
    mgr = make()
    with pytest.raises(ApiError) as e:
        run(mgr.rollout(req))
    assert (e.value.status, e.value.code) == (status, code)
    assert mgr.buffer.claimed == {} and mgr.buffer.holders == {} and not mgr.engine.calls  # type: ignore[attr-defined]
