"""Background generation (#19) across weight versions: a push cuts background segments at
the version boundary, `max_staleness` restarts or delivers them in time, and stops reach a
segment SGLang has not registered yet. Fake engine, helpers of `test_background.py`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from april_client.protocol import GroupsReq, RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from tests.unit.fake_engine import FakeEngine, SnapshotFakeEngine
from tests.unit.runtime.test_background import make, reference, spec, until


def test_a_weight_update_cuts_background_segments_at_the_version_boundary(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.003)
        await mgr.add_groups(GroupsReq(groups=[spec("w", 300)]))
        await until(lambda: bool(mgr.segments.running))
        await asyncio.sleep(0.2)
        await mgr.segments.weight_cut.before_update()
        await until(lambda: not mgr.engine.active)  # type: ignore[attr-defined]
        mgr.engine.version = "1"  # type: ignore[attr-defined]
        mgr.segments.weight_cut.after_update()
        # Handed back too (not only done generating): the integrity check compares the store
        # with the index, which differ while the background persists the finished group.
        await until(lambda: not mgr.segments.running and not mgr.buffer.holders)
        (s,) = (await mgr.buffer.read_group("w")).samples
        assert [x.weight_version for x in s.segments] == ["0", "1"]
        assert s.segments[0].end == s.segments[1].start > 0
        assert s.output_ids == reference(300)
        mgr.check_integrity()

    asyncio.run(go())


def test_a_background_sample_restarts_when_its_oldest_token_gets_too_stale(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.004)
        await mgr.add_groups(GroupsReq(groups=[spec("o", 400)], max_staleness=1))
        for version in ("1", "2"):  # two pushes while it generates
            await until(lambda: bool(mgr.segments.running))
            await asyncio.sleep(0.15)
            await mgr.segments.weight_cut.before_update()
            await until(lambda: not mgr.engine.active)  # type: ignore[attr-defined]
            mgr.engine.version = version  # type: ignore[attr-defined]
            mgr.segments.weight_cut.after_update()
        await until(lambda: not mgr.segments.running and not mgr.buffer.holders)
        (s,) = (await mgr.buffer.read_group("o")).samples
        # After the second push its oldest token would be 2 versions old (> 1): it restarted
        # from its prompt instead of extending stale work.
        assert mgr.counters.staleness_restarts == 1
        assert [x.weight_version for x in s.segments] == ["2"]
        assert s.output_ids == reference(400)
        assert s.staleness_restarts == 1  # persisted with it (a restart at a cut)

    asyncio.run(go())


def test_a_group_put_in_the_background_is_delivered_within_its_max_staleness(
    tmp_path: Path,
) -> None:
    """Found by `make bench-async` (max_staleness 1): 4 % of april-async's consumed tokens were
    2 versions old. A group that finished in the background (or that a call claimed before the
    background ran it again after a push) kept its oldest tokens until a later call delivered
    it. The bound of the call that put it there holds until delivery: such members restart."""

    async def go() -> None:
        mgr = make(tmp_path)
        await mgr.add_groups(GroupsReq(groups=[spec("old", 20)], max_staleness=1))
        await until(lambda: "old" not in mgr.background.wanted)  # finished under version 0
        mgr.engine.version = "1"  # type: ignore[attr-defined]
        await mgr.add_groups(GroupsReq(groups=[spec("new", 20)], max_staleness=1))
        await until(lambda: "new" not in mgr.background.wanted)  # finished under version 1
        mgr.engine.version = "2"  # type: ignore[attr-defined]
        r = await mgr.rollout(RolloutReq(groups=[], target_groups=2))
        by_id = {g.group_id: g.samples[0] for g in r.groups}
        # "old" would be 2 versions old (> 1): generated again; "new", 1 version old, kept.
        assert [x.weight_version for x in by_id["old"].segments] == ["2"]
        assert [x.weight_version for x in by_id["new"].segments] == ["1"]
        assert by_id["old"].output_ids == by_id["new"].output_ids == reference(20)
        assert mgr.counters.staleness_restarts == 1 and not mgr.background.bounds
        assert [by_id[g].staleness_restarts for g in ("old", "new")] == [1, 0]  # at the claim

    asyncio.run(go())


def test_a_stale_restart_at_a_claim_frees_the_members_snapshot(tmp_path: Path) -> None:
    """A background group paused by a call keeps a KV snapshot; when a later call claims it
    past its bound, the restart made that snapshot useless. Before the fix it stayed held on
    the engine (nothing referred to it; on one server no sweep frees it)."""

    async def go() -> None:
        eng = SnapshotFakeEngine(delay_s=0.003)
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b"))
        await mgr.add_groups(GroupsReq(groups=[spec("bg", 300)], max_staleness=1))
        await until(lambda: bool(mgr.segments.running) and bool(eng.calls))
        await asyncio.sleep(0.05)
        async with mgr.background.paused():  # stops it with a snapshot, as a call does
            (s,) = (await mgr.buffer.read_group("bg")).samples
            assert s.snapshot_bytes > 0 and eng.snaps == {"bg/0"}
            eng.version = "1"
            eng.version = "2"  # two pushes: its tokens of version 0 are past its bound
            r = await mgr.rollout(RolloutReq(groups=[], target_groups=1))
        (got,) = r.groups[0].samples
        assert [x.weight_version for x in got.segments] == ["2"]
        assert got.output_ids == reference(300)
        assert mgr.counters.staleness_restarts == 1
        assert eng.snaps == set()  # before the fix: {"bg/0"}, held for good
        mgr.check_integrity()

    asyncio.run(go())


class SlowDrop(SnapshotFakeEngine):
    """Frees a snapshot only once `freeing` is set (a busy scheduler's answer)."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.003)
        self.dropping, self.freeing = asyncio.Event(), asyncio.Event()

    async def drop_snapshot(self, key: str, slot: Any) -> None:
        self.dropping.set()
        await self.freeing.wait()
        await super().drop_snapshot(key, slot)


def test_a_call_cancelled_while_a_stale_restart_frees_the_snapshot_still_frees_it(
    tmp_path: Path,
) -> None:
    """Found by the simulator (seed 3518 with faults, window B): a call that claimed a group
    past its bound restarted the member (clearing where its snapshot lives), then awaited the
    snapshot's release; its client went away there, the release never happened, and the body
    was persisted without the snapshot: held on the engine, referred to by nobody."""

    async def go() -> None:
        eng = SlowDrop()
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b"))
        await mgr.add_groups(GroupsReq(groups=[spec("bg", 300)], max_staleness=1))
        await until(lambda: bool(mgr.segments.running) and bool(eng.calls))
        await asyncio.sleep(0.05)
        async with mgr.background.paused():  # stops it with a snapshot, as a call does
            eng.version = "1"
            eng.version = "2"  # two pushes: its tokens of version 0 are past its bound
        call = asyncio.ensure_future(mgr.rollout(RolloutReq(groups=[], target_groups=1)))
        await eng.dropping.wait()  # the call restarted it and frees its snapshot
        call.cancel()
        await asyncio.sleep(0.01)
        eng.freeing.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert eng.snaps == set()  # before the fix: {"bg/0"}, held for good
        (s,) = (await mgr.buffer.read_group("bg")).samples
        assert s.snapshot_bytes == 0
        mgr.check_integrity()

    asyncio.run(go())


def test_a_call_does_not_take_over_a_group_whose_segment_still_records_its_end(
    tmp_path: Path,
) -> None:
    """Found by the simulator (seed 11879 with faults, window A): a background segment that
    had left `running` but still recorded its end (awaiting its snapshot's release) was
    handed to a call with its group; the call tracked only the runs still running, so nobody
    waited for that task, which went on writing to a group the call held (the call even
    started the member again beside it). The group stays the background's until it ended."""

    async def go() -> None:
        eng = SlowDrop()
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b"))
        await mgr.add_groups(GroupsReq(groups=[spec("bg", 60)]))
        await until(lambda: bool(mgr.segments.running) and bool(eng.calls))
        await asyncio.sleep(0.02)
        async with mgr.background.paused():  # stopped with a snapshot, restored after
            pass
        await eng.dropping.wait()  # it finished from the restore; its task frees the snapshot
        (settling,) = mgr.background._ends
        assert not mgr.segments.running and not settling.done()
        call = asyncio.ensure_future(mgr.rollout(RolloutReq(groups=[], target_groups=1)))
        await asyncio.sleep(0.05)
        holder = mgr.buffer.owner_of("bg")
        eng.freeing.set()
        r = await call
        assert holder == "background"  # before the fix: the call's, its segment task running
        assert settling.done()
        (s,) = r.groups[0].samples
        assert s.output_ids == reference(60) and s.snapshot_bytes == 0
        assert eng.snaps == set()
        mgr.check_integrity()

    asyncio.run(go())


def test_a_failed_round_hands_its_groups_back_once_their_segments_recorded_their_end(
    tmp_path: Path,
) -> None:
    """Found by the simulator (seed 5914 with faults, window C): a background round whose
    commit failed stopped what still ran and handed every group back, but a segment task that
    had left `running` still awaited its snapshot's release: the group was persisted with the
    snapshot it was freeing, and the task then recorded its end into a body nobody held. The
    store referred to a snapshot the engine no longer had."""

    async def go() -> None:
        eng = SlowDrop()
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b"))
        await mgr.add_groups(GroupsReq(groups=[spec("bg", 60)]))
        await until(lambda: bool(mgr.segments.running) and bool(eng.calls))
        await asyncio.sleep(0.02)
        async with mgr.background.paused():  # stopped with a snapshot, restored after
            await mgr.add_groups(GroupsReq(groups=[spec("a", 150)]))
        real, failed = mgr.buffer.persist, []

        async def fails_once(put: Any, *args: Any) -> None:
            if not failed and any(g.group_id == "a" for g in put):
                failed.append(True)
                raise OSError(28, "No space left on device")
            await real(put, *args)

        mgr.buffer.persist = fails_once  # type: ignore[method-assign]
        await eng.dropping.wait()  # "bg" finished from the restore: its task frees the snapshot
        await until(lambda: bool(failed))  # "a" finished: its hand-back failed, the round too
        await asyncio.sleep(0.02)
        eng.freeing.set()
        await until(lambda: not mgr.buffer.holders and not mgr.background._task)
        stored = await mgr.store.read_groups(["bg"])
        assert eng.snaps == set()
        assert stored["bg"].samples[0].snapshot_bytes == 0  # before the fix: 100, freed since
        mgr.check_integrity()

    asyncio.run(go())


class Unhealthy(FakeEngine):
    """Its one slot is unhealthy while `down` is set: a segment waits to be placed."""

    down = False

    def healthy(self, slot: Any) -> bool:
        return not self.down


def test_a_call_does_not_take_over_a_segment_still_waiting_for_an_engine(
    tmp_path: Path,
) -> None:
    """Found by the simulator (seed 37576 with faults: an owner whose pushes failed on both
    engines): a background segment planned under the background's rule waited for a healthy
    engine when a call with `max_staleness: 0` took its group over; placed later, it continued
    version-0 tokens under version 2 in that call, which its own bound forbids."""

    async def go() -> None:
        eng = Unhealthy(delay_s=0.002)
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b"))
        await mgr.add_groups(GroupsReq(groups=[spec("bg", 60)]))  # no bound in the background
        await until(lambda: bool(mgr.segments.running) and bool(eng.calls))
        await asyncio.sleep(0.02)
        async with mgr.background.paused():  # stopped, its tokens of version 0 kept
            eng.version = "2"
            eng.down = True  # nowhere to place its continuation
        await until(lambda: any(r.placing for r in mgr.segments.running.values()))
        req = RolloutReq(groups=[], target_groups=1, max_staleness=0)
        call = asyncio.ensure_future(mgr.rollout(req))
        await asyncio.sleep(0.05)
        eng.down = False
        r = await call
        (s,) = r.groups[0].samples
        # Restarted by the call's own bound: before the fix, segments of versions 0 and 2.
        assert [x.weight_version for x in s.segments] == ["2"] and s.staleness_restarts == 1
        assert s.output_ids == reference(60)
        mgr.check_integrity()

    asyncio.run(go())


class LateRegistration(FakeEngine):
    """Like SGLang's TokenizerManager: a request is known only a moment after its segment
    starts (`register_s`), and an abort for an unknown request is dropped, not kept."""

    def __init__(self, register_s: float) -> None:
        super().__init__(delay_s=0.002)
        self.register_s = register_s
        self.known: set[str] = set()

    async def generate(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> Any:
        await asyncio.sleep(self.register_s)
        self.known.add(rid)
        return await super().generate(rid, input_ids, params)

    def abort(self, rid: str) -> None:
        if rid in self.known:
            super().abort(rid)


def test_a_call_pausing_the_background_resends_aborts_soon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background segment a weight update just continued is often unknown to SGLang when
    the next call pauses the background: the stop re-sends its abort within milliseconds, not
    after a whole poll (the 0.2 s a call waited for each pause before)."""
    from april_server.engine import segment_runner as segments

    waits: list[float] = []
    real_wait = asyncio.wait

    async def recording_wait(fs: Any, *, timeout: float | None = None, **kw: Any) -> Any:
        if timeout is not None:
            waits.append(timeout)
        return await real_wait(fs, timeout=timeout, **kw)

    async def go() -> None:
        mgr = RolloutManager(LateRegistration(register_s=0.03), Durable.open(tmp_path / "b"))
        await mgr.add_groups(GroupsReq(groups=[spec("bg", 500)]))
        await until(lambda: "bg" in mgr.background.running_groups())
        monkeypatch.setattr(segments.asyncio, "wait", recording_wait)
        run = mgr.segments.running["bg/0"]
        mgr.engine.known.discard(run.rid)  # type: ignore[attr-defined]  # not registered yet

        async def register_later() -> None:
            await asyncio.sleep(0.03)
            mgr.engine.known.add(run.rid)  # type: ignore[attr-defined]

        late = asyncio.ensure_future(register_later())
        async with mgr.background.paused():  # what a call does first
            (s,) = (await mgr.buffer.read_group("bg")).samples
        await late
        assert s.status == "partial" and len(s.output_ids) < 500  # stopped, not run out
        assert waits[0] < segments.ABORT_POLL_S / 10  # the first re-send comes soon
        assert mgr.background.pauses == 1
        monkeypatch.undo()
        mgr.check_integrity()

    asyncio.run(go())


def test_a_weight_update_resends_its_cut_to_a_segment_not_registered_yet(tmp_path: Path) -> None:
    """Else SGLang drops the cut (the request is unknown to it a moment after it started) and
    the update waits for the whole segment: a push stalled by a straggler."""

    async def go() -> None:
        eng = LateRegistration(register_s=0.0)
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b"))
        await mgr.add_groups(GroupsReq(groups=[spec("w", 500)]))
        await until(lambda: bool(mgr.segments.running))
        run = mgr.segments.running["w/0"]
        eng.known.discard(run.rid)  # not registered yet: the first cut is dropped
        await mgr.segments.weight_cut.before_update()
        await asyncio.sleep(0.03)
        eng.known.add(run.rid)
        await until(lambda: not eng.active)  # the segment left: the update may run
        eng.version = "1"
        mgr.segments.weight_cut.after_update()
        await until(lambda: not mgr.segments.running and not mgr.buffer.holders)
        (s,) = (await mgr.buffer.read_group("w")).samples
        assert [x.weight_version for x in s.segments] == ["0", "1"]  # cut, not run to its end
        assert s.output_ids == reference(500)
        mgr.check_integrity()

    asyncio.run(go())


# ---- review of 2026-12-06: nothing of ours starts inside a weight update ------------------------


def test_a_segment_started_during_a_weight_update_waits_for_its_end(tmp_path: Path) -> None:
    """Found by review: on one server only the segments running at a push (or a session's
    begin) were held; one started meanwhile (a call arriving, a refill, an answer, a resume)
    reached SGLang between a session's messages and generated on half-loaded weights. Now it
    waits for the update's end, as the owner's do; and a restore planned under the old
    weights re-prefills instead (their KV under the new ones would break exactness)."""
    from april_client.protocol import ResumeReq
    from april_server.rules.placement import Slot
    from tests.unit.fake_engine import SnapshotFakeEngine

    class Restores(SnapshotFakeEngine):
        restored: list[str]

        async def restore_snapshot(self, key: str, slot: Slot, namespace: str | None = None) -> int:
            self.restored.append(key)
            return 0

    async def go() -> None:
        eng = Restores()
        eng.restored = []
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b.sqlite"))
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 300)], on_quota="snapshot")
        await mgr.rollout(req)
        assert eng.snaps == {"long/0"}
        calls = len(eng.calls)
        await mgr.segments.weight_cut.before_update()  # a push (or a session) begins
        new = RolloutReq(groups=[spec("new", 20)], resume_first=False)
        fresh = asyncio.ensure_future(mgr.rollout(new))
        resumed = asyncio.ensure_future(mgr.resume(ResumeReq(sample_ids=["long/0"])))
        await asyncio.sleep(0.2)
        assert len(eng.calls) == calls and not fresh.done()  # before the fix: generating
        eng.version = "1"
        mgr.segments.weight_cut.after_update()
        await asyncio.wait_for(fresh, 30)
        (s,) = await asyncio.wait_for(resumed, 30)
        assert eng.restored == []  # planned under "0": re-prefilled under "1" instead
        assert eng.snaps == set() and s.snapshot_bytes == 0  # and freed (chaos found it leak)
        assert s.segments[-1].weight_version == "1" and s.segments[-1].kv == "recomputed"
        mgr.check_integrity()

    asyncio.run(go())


def test_every_pushed_version_counts_toward_staleness(tmp_path: Path) -> None:
    """Found by review: versions entered the history only when something generated under
    them, so two pushes with nothing running between ("s2", then "s3") counted as one, and
    a group from "s1" was continued at max_staleness=1 although two versions behind."""

    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        eng.version = "s1"
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b.sqlite"))
        await mgr.rollout(
            RolloutReq(groups=[spec("quick", 2), spec("long", 300)], on_quota="tokens")
        )
        for v in ("s2", "s3"):  # two pushes, nothing running
            await mgr.segments.weight_cut.before_update()
            eng.version = v
            mgr.segments.weight_cut.after_update()
        r = await mgr.rollout(RolloutReq(groups=[], target_groups=1, max_staleness=1))
        (s,) = r.groups[0].samples
        assert [seg.weight_version for seg in s.segments] == ["s3"]  # restarted from its prompt
        assert mgr.counters.staleness_restarts == 1  # before the fix: 0, continued
        mgr.check_integrity()

    asyncio.run(go())
