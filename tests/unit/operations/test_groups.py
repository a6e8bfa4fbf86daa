"""`POST /groups` (`operations/groups.py`): groups handed in without waiting generate in the
background before any call (or wait idle), bad input adds nothing, and a `request_id` names a
hand-in apart from a call. Fake engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from april_client.protocol import GroupsReq, RolloutReq
from april_server.wire.errors import ApiError
from tests.unit.runtime.test_background import listed_state, make, reference, spec, until


def test_prefetched_groups_generate_before_any_call(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path)
        resp = await mgr.add_groups(GroupsReq(groups=[spec("p1", 50, n=2), spec("p2", 60)]))
        assert resp.group_ids == ["p1", "p2"] and resp.started_samples == 3
        await until(lambda: all(mgr.buffer.idle.get(g).unfinished == 0 for g in ("p1", "p2")))
        await until(lambda: not mgr.segments.running and not mgr.background.running_groups())
        for gid, budget in (("p1", 50), ("p2", 60)):
            g = await mgr.buffer.read_group(gid)
            assert (await mgr.show_partial(gid)).state == "finished"
            assert all(s.output_ids == reference(budget) for s in g.samples)
        r = await mgr.rollout(RolloutReq(groups=[], target_groups=2))
        assert sorted(g.group_id for g in r.groups) == ["p1", "p2"]
        # start: idle only buffers; bad input adds nothing; a retry returns the same answer.
        idle = GroupsReq(groups=[spec("i1", 5)], start="idle", request_id="pre-1")
        assert (await mgr.add_groups(idle)).started_samples == 0
        assert await mgr.add_groups(idle) == (await mgr.add_groups(idle))
        await asyncio.sleep(0.1)
        assert await listed_state(mgr, "i1") == "idle" and not mgr.segments.running
        with pytest.raises(ApiError):
            await mgr.add_groups(GroupsReq(groups=[spec("i2", 5), spec("i1", 5)]))
        assert not mgr.buffer.known("i2")
        mgr.check_integrity()

    asyncio.run(go())


def test_a_request_id_names_a_hand_in_and_a_call_apart(tmp_path: Path) -> None:
    """Found by review: `/groups` and `/rollouts` remembered their answers under one key, so
    a step naming both "step-18" got a 500 (the stored answer of the other route failed to
    decode), or overwrote the record a rollout's retry needed."""

    async def go() -> None:
        mgr = make(tmp_path)
        pre = GroupsReq(groups=[spec("p", 5)], start="idle", request_id="step-18")
        first = await mgr.add_groups(pre)
        call = RolloutReq(groups=[spec("c", 5)], target_groups=2, request_id="step-18")
        r = await mgr.rollout(call)  # before the fix: msgspec ValidationError (a 500)
        assert sorted(g.group_id for g in r.groups) == ["c", "p"]
        assert await mgr.add_groups(pre) == first  # each still idempotent
        assert await mgr.rollout(call) == r
        mgr.check_integrity()

    asyncio.run(go())


def test_groups_whose_client_left_during_the_commit_are_handed_in(tmp_path: Path) -> None:
    """Found by the simulator (seed 0 with faults): a client that went away while its groups
    were being made durable left them durable, and its retry got the stored answer ("handed
    in"), but they were never handed to the background: they never ran, and their bound was
    never recorded (a later call delivered them staler than it allowed)."""

    async def go() -> None:
        mgr = make(tmp_path)
        real, gate = mgr.persister.persist, asyncio.Event()

        async def slow(*args: Any) -> None:
            await gate.wait()
            await real(*args)

        mgr.persister.persist = slow  # type: ignore[method-assign]
        req = GroupsReq(groups=[spec("p1", 20)], max_staleness=1, request_id="hand-in-1")
        first = asyncio.ensure_future(mgr.add_groups(req))
        await until(lambda: mgr.buffer.known("p1"))  # adopted: its commit is under way
        first.cancel()
        await asyncio.sleep(0)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        mgr.persister.persist = real  # type: ignore[method-assign]
        again = await mgr.add_groups(req)  # the stored answer
        assert again.group_ids == ["p1"] and again.started_samples == 1
        assert mgr.background.bounds.get("p1") == 1  # before the fix: never handed in
        await until(lambda: mgr.buffer.idle.get("p1").unfinished == 0)
        (s,) = (await mgr.buffer.read_group("p1")).samples
        assert s.output_ids == reference(20)
        mgr.check_integrity()

    asyncio.run(go())
