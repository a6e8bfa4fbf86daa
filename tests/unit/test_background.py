"""Background generation (#19): `on_quota: continue`, `POST /groups`, and how the background
gives way to calls, aborts, deletes, restarts and weight updates. Fake engine (its tokens are
a hash of the context, so an interrupted + continued sample equals an uninterrupted one)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from april_server.errors import ApiError
from april_server.manager import RolloutManager
from april_server.prefetch import add_groups
from april_server.protocol import AbortReq, GroupSpec, GroupsReq, RolloutReq
from april_server.rollout import rollout
from april_server.store import BufferStore
from tests.unit.fake_engine import FakeEngine, SnapshotFakeEngine, next_token

PROMPT = [1, 2, 3]


def spec(gid: str, budget: int, n: int = 1) -> GroupSpec:
    params = {"max_new_tokens": budget, "ignore_eos": True, "temperature": 0.0}
    return GroupSpec(gid, n=n, input_ids=PROMPT, sampling_params=params)


def reference(budget: int) -> list[int]:
    ctx, out = list(PROMPT), []
    for _ in range(budget):
        out.append(next_token(ctx, 64))
        ctx.append(out[-1])
    return out


async def until(cond: Any, timeout: float = 30.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


def make(path: Path, delay_s: float = 0.002) -> RolloutManager:
    return RolloutManager(FakeEngine(delay_s=delay_s), BufferStore(path / "b.sqlite"))


async def listed_state(mgr: RolloutManager, gid: str) -> str | None:
    return mgr.listed(await mgr.read_group(gid)).state


def test_continue_keeps_generating_after_the_answer(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path)
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 300)], on_quota="continue")
        r = await rollout(mgr, req)
        assert [g.group_id for g in r.groups] == ["quick"]
        assert r.buffered_group_ids == ["long"]
        # The call has answered; the straggler goes on, listed as buffered and running.
        await until(lambda: "long" in mgr.background.running_groups())
        assert await listed_state(mgr, "long") == "running"
        assert len(mgr.buffer.idle) == 1  # still counted as buffered
        await until(lambda: not mgr.background.running_groups())
        assert await listed_state(mgr, "long") == "finished"
        (s,) = (await mgr.read_group("long")).samples
        assert s.status == "truncated" and s.output_ids == reference(300)
        # Handed over in place: the segment the call started never stopped (no snapshot, no
        # restore, no second segment).
        assert len(s.segments) == 1 and mgr.background.pauses == 0
        # The next call gets it at once, without generating anything.
        calls = len(mgr.engine.calls)  # type: ignore[attr-defined]
        r2 = await rollout(mgr, RolloutReq(groups=[], target_groups=1))
        assert [g.group_id for g in r2.groups] == ["long"]
        assert len(mgr.engine.calls) == calls  # type: ignore[attr-defined]
        mgr.check_integrity()

    asyncio.run(go())


def test_a_call_takes_over_a_group_still_generating(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.004)
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 400)], on_quota="continue")
        await rollout(mgr, req)
        await until(lambda: "long" in mgr.background.running_groups())
        await asyncio.sleep(0.2)
        # A call claims it mid-generation: its segment keeps generating, now the call's, and
        # counts toward its quota (nothing stops, nothing restores).
        r = await rollout(mgr, RolloutReq(groups=[spec("new", 500)], target_groups=1))
        assert [g.group_id for g in r.groups] == ["long"]
        (s,) = r.groups[0].samples
        assert s.output_ids == reference(400)  # nothing lost or generated twice
        # One segment: the first call's, handed to the background at its answer, then to this
        # call, without ever stopping.
        assert len(s.segments) == 1 and s.segments[0].end == 400
        assert mgr.background.pauses == 0
        # ... and "new", which that call started, went back to the buffer idle (snapshot).
        assert not mgr.background.wanted
        # The taken-over segment counts in the call's figures, whole, and not the background's.
        (new,) = (await mgr.read_group("new")).samples
        assert r.stats.output_tokens == 400 + len(new.output_ids)
        assert mgr.background.tally.output_tokens == 0
        mgr.check_integrity()

    asyncio.run(go())


def test_a_call_takes_over_what_its_running_target_holds_and_the_rest_gives_way(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.003)
        await add_groups(mgr, GroupsReq(groups=[spec(f"g{i}", 300) for i in range(3)]))
        await until(lambda: len(mgr.background.running_groups()) == 3)
        await asyncio.sleep(0.05)
        req = RolloutReq(groups=[], target_groups=1, max_inflight_groups=1)
        r = await rollout(mgr, req)
        # The oldest passed to the call generating: one segment, never stopped.
        assert [g.group_id for g in r.groups] == ["g0"]
        (s,) = r.groups[0].samples
        assert len(s.segments) == 1 and s.output_ids == reference(300)
        # The two it had no room for stopped (one pause) and went on after the call.
        assert mgr.background.pauses == 1
        await until(lambda: not mgr.background.wanted and not mgr.buffer.owner)
        for gid in ("g1", "g2"):
            (x,) = (await mgr.read_group(gid)).samples
            assert x.output_ids == reference(300) and len(x.segments) == 2
        mgr.check_integrity()

    asyncio.run(go())


def test_a_continue_call_ending_beside_another_call_stops_its_stragglers(tmp_path: Path) -> None:
    """Only where nothing else holds the background do stragglers pass to it generating.
    Here a second call arrives while the first persists its answer: the straggler stops with
    what it generated persisted again (the first persist predates it), and goes on in the
    background once both calls have ended."""

    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.003)
        persist = mgr.persist
        second: list[asyncio.Task[Any]] = []

        async def persist_while_a_call_arrives(*args: Any, **kw: Any) -> None:
            if not second:
                req = RolloutReq(groups=[spec("other", 30)], target_groups=1, resume_first=False)
                second.append(asyncio.create_task(rollout(mgr, req)))
                await until(lambda: len(mgr.calls) == 2)
            await persist(*args, **kw)

        mgr.persist = persist_while_a_call_arrives  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 400)], on_quota="continue")
        r = await rollout(mgr, req)
        assert r.buffered_group_ids == ["long"]
        (x,) = (await mgr.read_group("long")).samples
        assert 0 < len(x.output_ids) < 400  # stopped, and what it made is durable
        assert len(x.segments) == 1
        await second[0]
        await until(lambda: not mgr.background.wanted and not mgr.buffer.owner)
        (x,) = (await mgr.read_group("long")).samples
        assert x.output_ids == reference(400) and len(x.segments) == 2
        mgr.check_integrity()

    asyncio.run(go())


def test_an_abort_while_a_continue_call_persists_keeps_what_it_asked_for(tmp_path: Path) -> None:
    """An abort (keep: tokens) arrives while the call persists its answer: the straggler is
    the abort's, not handed over; it stops for good with its tokens, persisted."""

    async def go() -> None:
        eng = SnapshotFakeEngine(delay_s=0.003)
        mgr = RolloutManager(eng, BufferStore(tmp_path / "b"))
        persist = mgr.persist
        aborts: list[asyncio.Task[Any]] = []

        async def persist_while_aborted(*args: Any, **kw: Any) -> None:
            if not aborts:
                aborts.append(asyncio.create_task(mgr.abort(AbortReq(all=True, keep="tokens"))))
                stopping = lambda: any(r.stopping for r in mgr.running.values())  # noqa: E731
                await until(lambda: aborts[0].done() or stopping())
            await persist(*args, **kw)

        mgr.persist = persist_while_aborted  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 400)], on_quota="continue")
        r = await rollout(mgr, req)
        assert r.buffered_group_ids == ["long"]
        await aborts[0]
        (x,) = (await mgr.read_group("long")).samples
        assert 0 < len(x.output_ids) < 400 and x.status == "partial"
        assert x.output_ids == reference(400)[: len(x.output_ids)]
        # The abort's keep (tokens), not the snapshot the call's stop would have taken.
        assert x.snapshot_bytes == 0 and not eng.snaps
        await asyncio.sleep(0.1)
        assert not mgr.running and not mgr.background.wanted
        assert await listed_state(mgr, "long") == "idle"
        mgr.check_integrity()

    asyncio.run(go())


def test_prefetched_groups_generate_before_any_call(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path)
        resp = await add_groups(mgr, GroupsReq(groups=[spec("p1", 50, n=2), spec("p2", 60)]))
        assert resp.group_ids == ["p1", "p2"] and resp.started_samples == 3
        await until(lambda: all(mgr.buffer.idle.get(g).unfinished == 0 for g in ("p1", "p2")))
        await until(lambda: not mgr.running and not mgr.background.running_groups())
        for gid, budget in (("p1", 50), ("p2", 60)):
            g = await mgr.read_group(gid)
            assert mgr.listed(g).state == "finished"
            assert all(s.output_ids == reference(budget) for s in g.samples)
        r = await rollout(mgr, RolloutReq(groups=[], target_groups=2))
        assert sorted(g.group_id for g in r.groups) == ["p1", "p2"]
        # start: idle only buffers; bad input adds nothing; a retry returns the same answer.
        idle = GroupsReq(groups=[spec("i1", 5)], start="idle", request_id="pre-1")
        assert (await add_groups(mgr, idle)).started_samples == 0
        assert await add_groups(mgr, idle) == (await add_groups(mgr, idle))
        await asyncio.sleep(0.1)
        assert await listed_state(mgr, "i1") == "idle" and not mgr.running
        with pytest.raises(ApiError):
            await add_groups(mgr, GroupsReq(groups=[spec("i2", 5), spec("i1", 5)]))
        assert not mgr.buffer.known("i2")
        mgr.check_integrity()

    asyncio.run(go())


def test_abort_and_delete_stop_background_samples_for_good(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.005)
        await add_groups(mgr, GroupsReq(groups=[spec("a", 450), spec("d", 450)]))
        await until(lambda: len(mgr.background.running_groups()) == 2)
        await asyncio.sleep(0.1)
        await mgr.delete("d")
        assert not mgr.buffer.known("d")
        out = await mgr.abort(AbortReq(all=True, keep="tokens"))
        assert [s.sample_id for s in out.samples] == ["a/0"]
        assert 0 < len(out.samples[0].output_ids) < 450
        await asyncio.sleep(0.2)
        assert not mgr.running and not mgr.background.wanted  # not restarted later
        r = await rollout(mgr, RolloutReq(groups=[spec("x", 2)], target_groups=1))
        await asyncio.sleep(0.1)
        assert [g.group_id for g in r.groups] == ["x"] and not mgr.running
        mgr.check_integrity()

    asyncio.run(go())


def test_a_restart_keeps_what_was_persisted(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.005)
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 480)], on_quota="continue")
        await rollout(mgr, req)
        (stored,) = mgr.store.load_all()  # what the answer acknowledged
        acknowledged = len(stored.samples[0].output_ids)
        await until(lambda: "long" in mgr.background.running_groups())
        await asyncio.sleep(0.1)
        # A crash now: the store holds what the call's answer acknowledged (the process dies
        # without handing anything back).
        mgr.store.close()
        again = make(tmp_path)
        (s,) = (await again.read_group("long")).samples
        assert s.status == "partial" and len(s.output_ids) >= acknowledged
        assert s.output_ids == reference(480)[: len(s.output_ids)]
        assert not again.background.wanted  # a restart treats them like any buffered group
        again.check_integrity()

    asyncio.run(go())


def test_a_weight_update_cuts_background_segments_at_the_version_boundary(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.003)
        await add_groups(mgr, GroupsReq(groups=[spec("w", 300)]))
        await until(lambda: bool(mgr.running))
        await asyncio.sleep(0.2)
        await mgr.segments.before_update()
        await until(lambda: not mgr.engine.active)  # type: ignore[attr-defined]
        mgr.engine.version = "1"  # type: ignore[attr-defined]
        mgr.segments.after_update()
        # Handed back too (not only done generating): the integrity check compares the store
        # with the index, which differ while the background persists the finished group.
        await until(lambda: not mgr.running and not mgr.buffer.owner)
        (s,) = (await mgr.read_group("w")).samples
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
        await add_groups(mgr, GroupsReq(groups=[spec("o", 400)], max_staleness=1))
        for version in ("1", "2"):  # two pushes while it generates
            await until(lambda: bool(mgr.running))
            await asyncio.sleep(0.15)
            await mgr.segments.before_update()
            await until(lambda: not mgr.engine.active)  # type: ignore[attr-defined]
            mgr.engine.version = version  # type: ignore[attr-defined]
            mgr.segments.after_update()
        await until(lambda: not mgr.running and not mgr.buffer.owner)
        (s,) = (await mgr.read_group("o")).samples
        # After the second push its oldest token would be 2 versions old (> 1): it restarted
        # from its prompt instead of extending stale work.
        assert mgr.counters.staleness_restarts == 1
        assert [x.weight_version for x in s.segments] == ["2"]
        assert s.output_ids == reference(400)
        assert s.staleness_restarts == 1  # persisted with it (a restart at a cut)

    asyncio.run(go())


def test_aborting_a_finished_call_stops_what_it_left_in_the_background(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.005)
        req = RolloutReq(groups=[spec("q", 3), spec("left", 450)], on_quota="continue")
        r = await rollout(mgr, req)
        await until(lambda: "left" in mgr.background.running_groups())
        out = await mgr.abort(AbortReq(batch_id=r.batch_id, keep="tokens"))
        assert [s.sample_id for s in out.samples] == ["left/0"]
        await asyncio.sleep(0.1)
        assert not mgr.running and not mgr.background.wanted
        mgr.check_integrity()

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
        await add_groups(mgr, GroupsReq(groups=[spec("old", 20)], max_staleness=1))
        await until(lambda: "old" not in mgr.background.wanted)  # finished under version 0
        mgr.engine.version = "1"  # type: ignore[attr-defined]
        await add_groups(mgr, GroupsReq(groups=[spec("new", 20)], max_staleness=1))
        await until(lambda: "new" not in mgr.background.wanted)  # finished under version 1
        mgr.engine.version = "2"  # type: ignore[attr-defined]
        r = await rollout(mgr, RolloutReq(groups=[], target_groups=2))
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
        mgr = RolloutManager(eng, BufferStore(tmp_path / "b"))
        await add_groups(mgr, GroupsReq(groups=[spec("bg", 300)], max_staleness=1))
        await until(lambda: bool(mgr.running) and bool(eng.calls))
        await asyncio.sleep(0.05)
        async with mgr.background.paused():  # stops it with a snapshot, as a call does
            (s,) = (await mgr.read_group("bg")).samples
            assert s.snapshot_bytes > 0 and eng.snaps == {"bg/0"}
            eng.version = "1"
            eng.version = "2"  # two pushes: its tokens of version 0 are past its bound
            r = await rollout(mgr, RolloutReq(groups=[], target_groups=1))
        (got,) = r.groups[0].samples
        assert [x.weight_version for x in got.segments] == ["2"]
        assert got.output_ids == reference(300)
        assert mgr.counters.staleness_restarts == 1
        assert eng.snaps == set()  # before the fix: {"bg/0"}, held for good
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
    from april_server import segments

    waits: list[float] = []
    real_wait = asyncio.wait

    async def recording_wait(fs: Any, *, timeout: float | None = None, **kw: Any) -> Any:
        if timeout is not None:
            waits.append(timeout)
        return await real_wait(fs, timeout=timeout, **kw)

    async def go() -> None:
        mgr = RolloutManager(LateRegistration(register_s=0.03), BufferStore(tmp_path / "b"))
        await add_groups(mgr, GroupsReq(groups=[spec("bg", 500)]))
        await until(lambda: "bg" in mgr.background.running_groups())
        monkeypatch.setattr(segments.asyncio, "wait", recording_wait)
        run = mgr.running["bg/0"]
        mgr.engine.known.discard(run.rid)  # type: ignore[attr-defined]  # not registered yet

        async def register_later() -> None:
            await asyncio.sleep(0.03)
            mgr.engine.known.add(run.rid)  # type: ignore[attr-defined]

        late = asyncio.ensure_future(register_later())
        async with mgr.background.paused():  # what a call does first
            (s,) = (await mgr.read_group("bg")).samples
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
        mgr = RolloutManager(eng, BufferStore(tmp_path / "b"))
        await add_groups(mgr, GroupsReq(groups=[spec("w", 500)]))
        await until(lambda: bool(mgr.running))
        run = mgr.running["w/0"]
        eng.known.discard(run.rid)  # not registered yet: the first cut is dropped
        await mgr.segments.before_update()
        await asyncio.sleep(0.03)
        eng.known.add(run.rid)
        await until(lambda: not eng.active)  # the segment left: the update may run
        eng.version = "1"
        mgr.segments.after_update()
        await until(lambda: not mgr.running and not mgr.buffer.owner)
        (s,) = (await mgr.read_group("w")).samples
        assert [x.weight_version for x in s.segments] == ["0", "1"]  # cut, not run to its end
        assert s.output_ids == reference(500)
        mgr.check_integrity()

    asyncio.run(go())
