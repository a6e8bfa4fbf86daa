"""Sampling masks through calls, `/groups`, `/resume` and a restart, against a fake engine whose
kept set and sampling logprob are functions of the context (tests/unit/fake_engine.py): however
a sample is cut, every token's row is the one an uninterrupted run would have given it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_client import sampling_mask as decode
from april_client.protocol import GroupSpec, GroupsReq, ResumeReq, RolloutReq, Sample
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.wire.errors import ApiError
from tests.unit.calls.test_rollout import make, reference, spec
from tests.unit.fake_engine import FakeEngine, kept_logprob, kept_set
from tests.unit.idle import idle_bodies

VOCAB = 64


def masked(gid: str, budget: int, prompt: list[int]) -> GroupSpec:
    return msgspec.structs.replace(spec(gid, 1, [budget], prompt), return_sampling_mask=True)


def assert_rows_of_an_uninterrupted_run(s: Sample) -> None:
    mask = s.sampling_mask
    assert mask is not None and mask.num_rows == len(s.output_ids)
    ctx = list(s.prompt_ids)
    for i, (tok, row) in enumerate(zip(s.output_ids, decode.rows(mask), strict=True)):
        assert row == kept_set(ctx, tok, VOCAB), i
        assert mask.logprobs[i] == kept_logprob(ctx, tok, VOCAB), i
        ctx.append(tok)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budgets=st.lists(st.integers(1, 40), min_size=3, max_size=6),
    on_quota=st.sampled_from(["tokens", "snapshot", "continue"]),
    delay=st.sampled_from([0.0, 0.0005]),
)
def test_cut_samples_carry_the_rows_of_an_uninterrupted_run(
    budgets: list[int], on_quota: str, delay: float
) -> None:
    async def go() -> None:
        mgr = make(delay_s=delay)
        groups = [masked(f"g{i}", b, [i + 1, 3]) for i, b in enumerate(budgets)]
        req = RolloutReq(groups=groups, target_groups=1, on_quota=on_quota)  # type: ignore[arg-type]
        got = {g.group_id: g for g in (await mgr.rollout(req)).groups}
        while len(got) < len(budgets):
            more = await mgr.rollout(RolloutReq(target_groups=1, on_quota=on_quota))  # type: ignore[arg-type]
            got.update({g.group_id: g for g in more.groups})
            mgr.check_integrity()
        for i, b in enumerate(budgets):
            s = got[f"g{i}"].samples[0]
            assert s.output_ids == reference([i + 1, 3], b)
            assert_rows_of_an_uninterrupted_run(s)
        await mgr.close()

    asyncio.run(go())


def test_the_rows_survive_a_restart_and_the_continuation_extends_them(tmp_path: Path) -> None:
    db = tmp_path / "state" / "buffer.sqlite"

    async def first() -> list[Any]:
        mgr = make(db)
        groups = [masked("short", 2, [1, 2]), masked("long", 300, [3, 4])]
        await mgr.rollout(RolloutReq(groups=groups, target_groups=1))
        idle = idle_bodies(mgr.buffer)
        await mgr.close()
        return idle

    before = asyncio.run(first())
    (long,) = [g for g in before if g.group_id == "long"]
    s = long.samples[0]
    assert 0 < len(s.output_ids) < 300 and s.sampling_mask is not None
    assert_rows_of_an_uninterrupted_run(s)
    mgr = make(db)
    assert idle_bodies(mgr.buffer) == before  # rows and all, as persisted
    done = asyncio.run(mgr.rollout(RolloutReq(target_groups=1))).groups[0].samples[0]
    assert len(done.output_ids) == 300
    assert_rows_of_an_uninterrupted_run(done)


def test_groups_and_resume_turn_it_on_and_off() -> None:
    async def go() -> None:
        mgr = make()
        await mgr.add_groups(GroupsReq(groups=[spec("a", 1, [200])], start="idle"))
        await mgr.add_groups(
            GroupsReq(groups=[spec("b", 1, [200])], start="idle", return_sampling_mask=True)
        )
        b = (await mgr.buffer.read_samples(["b/0"]))["b/0"]
        assert b.return_sampling_mask and b.sampling_mask is None
        await mgr.rollout(RolloutReq(groups=[spec("t", 1, [5])], target_groups=1))
        a = (await mgr.buffer.read_samples(["a/0"]))["a/0"]
        cut = len(a.output_ids)
        (a,) = await mgr.resume(ResumeReq(sample_ids=["a/0"], return_sampling_mask=True))
        assert a.sampling_mask is not None and a.sampling_mask.num_rows == 200
        counts = decode.counts(a.sampling_mask)
        assert counts[:cut] == [0] * cut and all(counts[cut:])  # generated before it asked
        (b,) = await mgr.resume(ResumeReq(sample_ids=["b/0"]))
        assert_rows_of_an_uninterrupted_run(b)
        await mgr.close()

    asyncio.run(go())


def test_resume_off_drops_the_record() -> None:
    async def go() -> None:
        mgr = make()
        req = RolloutReq(groups=[masked("x", 300, [5]), spec("t", 1, [3])], target_groups=1)
        await mgr.rollout(req)
        (x,) = await mgr.resume(ResumeReq(sample_ids=["x/0"], return_sampling_mask=False))
        assert x.sampling_mask is None and not x.return_sampling_mask
        await mgr.close()

    asyncio.run(go())


@pytest.mark.parametrize(
    "req",
    [
        RolloutReq(
            groups=[GroupSpec("a", input_ids=[1], sampling_params={"temperature": 1.0})],
            return_sampling_mask=True,
        ),
        RolloutReq(  # a member's params that drop the top_k
            groups=[
                GroupSpec(
                    "a",
                    n=2,
                    input_ids=[1],
                    sampling_params={"temperature": 1.0, "top_k": 5},
                    member_params=[{}, {"top_k": -1}],
                    return_sampling_mask=True,
                )
            ]
        ),
    ],
)
def test_params_that_give_no_mask_are_refused_before_anything_starts(req: RolloutReq) -> None:
    mgr = make()
    with pytest.raises(ApiError) as e:
        asyncio.run(mgr.rollout(req))
    assert (e.value.status, e.value.code) == (400, "invalid_sampling_params")
    assert mgr.buffer.holders == {} and not mgr.engine.calls  # type: ignore[attr-defined]


def test_a_resume_override_that_gives_no_mask_is_refused() -> None:
    async def go() -> None:
        mgr = make()
        await mgr.rollout(RolloutReq(groups=[masked("x", 300, [5]), spec("t", 1, [3])]))
        override = {"temperature": 1.0, "top_k": -1}
        with pytest.raises(ApiError) as e:
            await mgr.resume(ResumeReq(sample_ids=["x/0"], sampling_params=override))
        assert e.value.code == "invalid_sampling_params"
        assert mgr.buffer.holders.get("x") is None  # nothing held after the refusal
        await mgr.close()

    asyncio.run(go())


def test_an_engine_without_masks_refuses_them() -> None:
    class NoMasks(FakeEngine):
        sampling_mask_tokens = None

    mgr = RolloutManager(NoMasks(), Durable.open(None))
    req = RolloutReq(groups=[spec("a", 1, [3])], return_sampling_mask=True)
    with pytest.raises(ApiError) as e:
        asyncio.run(mgr.rollout(req))
    assert (e.value.status, e.value.code) == (400, "sampling_mask_unavailable")
