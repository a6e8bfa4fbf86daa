"""What a segment leaves of its sample's KV snapshot when it ends off the plain path
(`segment_runner.py`): a staleness restart frees the snapshot it made useless, a restore that
made nothing visible still frees the one it tried, a segment that found no engine keeps the one
still usable. Fake engine with snapshots, real SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from april_client.protocol import RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from tests.unit.fake_engine import SnapshotFakeEngine
from tests.unit.group_specs import spec


def test_a_staleness_restart_frees_the_snapshot(tmp_path: Path) -> None:
    async def go() -> None:
        eng = SnapshotFakeEngine()
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b.sqlite"))
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 400)], on_quota="snapshot")
        await mgr.rollout(req)
        assert eng.snaps == {"long/0"}
        eng.version = "2"  # two weight updates later: too stale for max_staleness=1
        call = asyncio.ensure_future(
            mgr.rollout(RolloutReq(groups=[], target_groups=1, max_staleness=1))
        )
        await asyncio.sleep(0.1)
        assert mgr.segments.running["long/0"].sample.output_ids == []  # restarted from its prompt
        assert mgr.counters.staleness_restarts == 1
        assert eng.snaps == set()  # before the fix: held until the sample left the server
        await call
        mgr.check_integrity()

    asyncio.run(go())


def test_a_restore_that_restored_nothing_does_not_leak_the_snapshot(tmp_path: Path) -> None:
    """The fake's restore makes nothing visible (as after an eviction of its pages, no free
    slots, or a late answer), yet the store still holds the snapshot: the segment that tried
    it must free it, or its bytes stay held after the buffer drained (#23 item 10)."""

    async def go() -> None:
        eng = SnapshotFakeEngine()
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b.sqlite"))
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 300)], on_quota="snapshot")
        await mgr.rollout(req)
        assert eng.snaps == {"long/0"}
        r = await mgr.rollout(RolloutReq(groups=[], target_groups=1))  # restore planned
        assert [g.group_id for g in r.groups] == ["long"]
        assert eng.snaps == set()  # before the fix: {"long/0"}, with nothing pointing at it
        mgr.check_integrity()

    asyncio.run(go())


def test_a_segment_that_found_no_engine_keeps_the_snapshot_it_can_still_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a segment that never got a healthy slot freed the sample's snapshot
    when it ended, restart or not, while the sample's figures still pointed at it (a later
    restore planned, then quietly re-prefilled; a quota stop lost the snapshot it kept)."""
    from april_client.protocol import ResumeReq
    from april_server.engine import segment_runner as segments_mod
    from april_server.rules.placement import Slot

    monkeypatch.setattr(segments_mod, "ENGINE_WAIT_S", 0.2)
    monkeypatch.setattr(segments_mod, "HEALTH_POLL_S", 0.02)

    class Unreachable(SnapshotFakeEngine):
        down = False

        def healthy(self, slot: Slot) -> bool:
            return not self.down

    async def go() -> None:
        eng = Unreachable()
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b.sqlite"))
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 400)], on_quota="snapshot")
        await mgr.rollout(req)
        assert eng.snaps == {"long/0"}
        eng.down = True
        (s,) = await mgr.resume(ResumeReq(sample_ids=["long/0"]))  # nowhere to run
        assert s.status == "partial" and s.snapshot_bytes > 0
        assert eng.snaps == {"long/0"}  # before the fix: set(), the figures still set
        mgr.check_integrity()

    asyncio.run(go())
