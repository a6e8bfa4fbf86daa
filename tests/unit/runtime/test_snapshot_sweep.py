"""The owner's snapshot sweep (`snapshot_sweep.py`, #23 item 10): it frees a snapshot only when
it is old, and referenced by nobody (no running sample, no buffered sample recording it there)
on two sweeps in a row; everything referenced survives any number of sweeps."""

from __future__ import annotations

import asyncio

from april_client.protocol import AbortReq, GroupSpec, RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.placement import LOCAL, Slot
from april_server.runtime.snapshot_sweep import SnapshotSweep
from tests.unit.fake_engine import SnapshotFakeEngine
from tests.unit.idle import idle_bodies

NO_EOS = {"ignore_eos": True}
HERE = Slot(LOCAL, 0)


class ListingEngine(SnapshotFakeEngine):
    """Lists its snapshots, each 100 s old unless `ages` says otherwise."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.005)
        self.ages: dict[str, float] = {}

    async def snapshot_keys(self) -> dict[Slot, dict[str, float]]:
        return {HERE: {k: self.ages.get(k, 100.0) for k in self.snaps}}


def sweep_of(mgr: RolloutManager, min_age_s: float) -> SnapshotSweep:
    assert mgr.segments.snap is not None
    return SnapshotSweep(
        mgr.segments.snap, mgr.segments.running, mgr.buffer, mgr.places, min_age_s=min_age_s
    )


def spec(gid: str, tokens: int) -> GroupSpec:
    return GroupSpec(gid, input_ids=[1, 2], sampling_params={"max_new_tokens": tokens, **NO_EOS})


async def buffered_with_snapshot(eng: ListingEngine, mgr: RolloutManager) -> None:
    """'long' buffered as a partial whose snapshot is recorded ('short' meets the quota)."""
    req = RolloutReq(groups=[spec("long", 400), spec("short", 40)], max_inflight_groups=2)
    call = asyncio.ensure_future(mgr.rollout(req))
    await asyncio.sleep(0.05)
    await mgr.abort(AbortReq(sample_ids=["long/0"], keep="snapshot"))
    await call
    (stored,) = idle_bodies(mgr.buffer)
    assert stored.samples[0].snapshot_bytes == 100 and eng.snaps == {"long/0"}


def test_only_old_snapshots_nobody_refers_to_are_freed_on_the_second_sweep() -> None:
    async def go() -> None:
        eng = ListingEngine()
        mgr = RolloutManager(eng, Durable.open(None))
        await buffered_with_snapshot(eng, mgr)
        sweep = sweep_of(mgr, min_age_s=30.0)
        eng.snaps |= {"ghost/0", "long/1", "young/0"}  # leaked, leaked, too young to judge
        eng.ages["young/0"] = 5.0
        assert await sweep.sweep_once() == 0  # suspects only
        assert sweep.suspects == {(HERE, "ghost/0"), (HERE, "long/1")}
        assert await sweep.sweep_once() == 2
        assert eng.snaps == {"long/0", "young/0"}
        for _ in range(3):  # the buffered sample's own snapshot stays, however often it sweeps
            await sweep.sweep_once()
        assert eng.snaps == {"long/0", "young/0"} and sweep.stats()["snapshots_swept"] == 2
        # The same key held on another slot than the one its sample records is a leak.
        other = Slot(LOCAL, 1)
        got = await sweep._unreferenced([(other, "long/0"), (HERE, "long/0")])
        assert got == {(other, "long/0")}
        # Once the group is deleted its snapshot is freed by the delete, not the sweep.
        await mgr.delete("long")
        assert eng.snaps == {"young/0"}

    asyncio.run(go())


def test_a_snapshot_whose_sample_runs_or_is_held_by_a_call_is_never_freed() -> None:
    async def go() -> None:
        eng = ListingEngine()
        mgr = RolloutManager(eng, Durable.open(None))
        sweep = sweep_of(mgr, min_age_s=0.0)
        req = RolloutReq(groups=[spec("run", 400)], target_groups=1)
        call = asyncio.ensure_future(mgr.rollout(req))
        while "run/0" not in mgr.segments.running:
            await asyncio.sleep(0.005)
        eng.snaps.add("run/0")  # e.g. the snapshot its segment restored from
        for _ in range(3):
            assert await sweep.sweep_once() == 0
        assert "run/0" in eng.snaps
        await mgr.abort(AbortReq(all=True))
        await call
        # Held by nothing now (aborted without a snapshot kept): swept on two more rounds.
        eng.snaps.add("run/0")
        await sweep.sweep_once()
        assert await sweep.sweep_once() == 1 and not eng.snaps

    asyncio.run(go())
