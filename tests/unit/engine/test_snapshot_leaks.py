"""Paths where an engine could keep a snapshot the owner no longer knows of (`segment_runner.py`,
`weight_cut.py`), found by reading after the 10-minute owner chaos run's sweep still freed 4 of
them. A plan that gives up a sample's old snapshot (its weights changed, or the segment runs
elsewhere) clears the sample's figures and leaves freeing it to the engine at the segment's
start: a segment that never gets there must free it itself. Each test fails on the code before
its fix."""

from __future__ import annotations

import asyncio
import copy

from april_client.protocol import ResumeReq
from april_server.engine.base import EngineUnavailable, SegmentCall, SegmentOutcome
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.placement import Slot
from tests.unit.engine.test_segment_runner import group
from tests.unit.fake_engine import SnapshotFakeEngine, segment_runner_over
from tests.unit.fleet.test_fleet import fleet_over
from tests.unit.fleet.test_snapshot_drops import DropServers
from tests.unit.runtime.test_snapshot_sweep import ListingEngine, buffered_with_snapshot


class GoneOnce(ListingEngine):
    """Its first segment that should free a snapshot fails before it reaches the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: list[SegmentCall] = []

    async def run_segment(self, call: SegmentCall) -> SegmentOutcome:
        if call.drop is not None and not self.failed:
            self.failed.append(call)
            raise EngineUnavailable(call.slot, "connection refused before the segment started")
        return await super().run_segment(call)


def test_a_segment_that_failed_before_freeing_the_old_snapshot_frees_it() -> None:
    async def go() -> None:
        eng = GoneOnce()
        mgr = RolloutManager(eng, Durable.open(None))
        await buffered_with_snapshot(eng, mgr)
        eng.version = "1"  # new weights: the snapshot is of no use, the plan frees it
        (s,) = await mgr.resume(ResumeReq(sample_ids=["long/0"]))
        assert eng.failed and eng.failed[0].drop is not None  # the first attempt failed
        assert s.status == "truncated" and s.snapshot_bytes == 0
        assert eng.snaps == set()  # before the fix: {"long/0"}, held for good

    asyncio.run(go())


def test_a_segment_stopped_while_a_weight_update_held_it_frees_the_old_snapshot() -> None:
    async def go() -> None:
        servers = DropServers(["a:1"])
        fleet = fleet_over(servers, ["a:1"])
        await fleet.probe_all()
        fleet.weights.hold_segments()  # a weight update is reaching the engines: new segments wait
        here = Slot("a:1", 0)
        call = SegmentCall("r1", "s/0", [1, 2], {"max_new_tokens": 1}, here, drop=here)
        seg = asyncio.ensure_future(fleet.run_segment(call))
        await asyncio.sleep(0.01)
        fleet.abort("r1")  # stopped meanwhile: it never reaches the engine
        out = await asyncio.wait_for(seg, 5)
        assert out.result.finish_reason == "abort"
        assert servers.drops == [("a:1", "s/0")]  # before the fix: [], the snapshot stayed
        await fleet.close()

    asyncio.run(go())


class ListsLate(SnapshotFakeEngine):
    """Lists what it holds at once, and answers only when let go (a busy scheduler)."""

    def __init__(self) -> None:
        super().__init__(lists=True)
        self.listed, self.answer = asyncio.Event(), asyncio.Event()

    async def snapshot_keys(self) -> dict[Slot, dict[str, float]]:
        held = await super().snapshot_keys()
        self.listed.set()
        await self.answer.wait()
        return held


def test_a_listing_that_raced_a_new_snapshot_leaves_the_new_one_its_place() -> None:
    """Found by the simulator (seed 21896): a `/partials` page asked the engines what they
    hold; while it waited, the sample's segment freed its old snapshot and left a new one. The
    answer, about the old one, cleared the place of the new one, held on its engine with
    nothing pointing at it. (The page reads bodies from the store: copies of the samples.)"""

    async def go() -> None:
        eng = ListsLate()
        runner = segment_runner_over(eng)
        places, here = runner.places, Slot()
        (s,), (t,) = group("g", 50).samples, group("t", 50).samples
        for x in (s, t):
            places.record(x, 100, here)
        page = asyncio.ensure_future(runner.refresh([copy.deepcopy(s), t]))
        await eng.listed.wait()  # it holds neither, as listed: both look evicted
        places.clear(s)  # a segment of s frees its snapshot ...
        eng.snaps.add(s.sample_id)
        places.record(s, 100, here)  # ... and leaves a new one
        eng.answer.set()
        await page
        assert places.of(t) is None and t.snapshot_bytes == 0  # evicted indeed
        assert places.of(s) == here and len(places) == 1  # before the fix: no place for it

    asyncio.run(go())
