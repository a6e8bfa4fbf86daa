"""`request_id` after a cancelled attempt (`rollout.py`'s `Rollout`): a retry sent while the
attempt winds down waits for it and runs again; one sent after it ended (even after a restart)
claims the groups it buffered; none recreates a group another call delivered meanwhile. Fake
engine, real SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from april_client.protocol import RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from tests.unit.fake_engine import FakeEngine
from tests.unit.group_specs import spec


def test_a_retry_after_a_cancelled_call_runs_again(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        req = RolloutReq(
            groups=[spec("a", 400), spec("b", 400)], target_groups=1, request_id="step-7"
        )
        first = asyncio.ensure_future(mgr.rollout(req))
        await asyncio.sleep(0.1)
        # A retry sent while the first attempt winds down waits for it, then runs itself.
        early = asyncio.ensure_future(mgr.rollout(req))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        r = await early
        assert len(r.groups) == 1 and r.groups[0].group_id in ("a", "b")
        other = ({"a", "b"} - {r.groups[0].group_id}).pop()
        assert r.buffered_group_ids == [other]
        # A later retry gets the same answer, and runs nothing.
        calls = len(mgr.engine.calls)  # type: ignore[attr-defined]
        assert await mgr.rollout(req) == r
        assert len(mgr.engine.calls) == calls  # type: ignore[attr-defined]
        mgr.check_integrity()

    asyncio.run(go())


def test_a_retry_after_the_cancelled_call_ended_claims_its_groups(tmp_path: Path) -> None:
    async def go() -> None:
        path = tmp_path / "b.sqlite"
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(path))
        req = RolloutReq(
            groups=[spec("a", 300), spec("b", 300)], target_groups=2, request_id="step-8"
        )
        first = asyncio.ensure_future(mgr.rollout(req))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert {e.group_id for e in mgr.buffer.idle.oldest()} == {"a", "b"}
        # Even after a restart: the attempt is remembered with the buffer, durably.
        mgr.store.close()
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(path))
        r = await mgr.rollout(req)  # before the fix: 409 group_exists
        assert sorted(g.group_id for g in r.groups) == ["a", "b"]
        assert all(len(g.samples[0].output_ids) == 300 for g in r.groups)
        assert await mgr.rollout(req) == r
        mgr.check_integrity()

    asyncio.run(go())


def test_a_retry_does_not_recreate_a_group_another_call_delivered(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        req = RolloutReq(
            groups=[spec("a", 300), spec("b", 300)], target_groups=1, request_id="step-9"
        )
        first = asyncio.ensure_future(mgr.rollout(req))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        other = await mgr.rollout(RolloutReq(groups=[], target_groups=1, on_quota="tokens"))
        (taken,) = [g.group_id for g in other.groups]
        r = await mgr.rollout(req)
        assert [g.group_id for g in r.groups] == [({"a", "b"} - {taken}).pop()]
        assert not len(mgr.buffer.idle)
        mgr.check_integrity()

    asyncio.run(go())
