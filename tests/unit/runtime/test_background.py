"""Background generation: `on_quota: continue`, and how the background gives way to calls and
restarts (weight updates and staleness: `test_background_versions.py`; `POST /groups` and the
aborts that reach the background: `tests/unit/operations/`). Fake engine (its tokens are a
hash of the context, so an interrupted + continued sample equals an uninterrupted one)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from april_client.protocol import GroupSpec, GroupsReq, RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from tests.unit.fake_engine import FakeEngine, next_token
from tests.unit.waiting import until

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


def make(path: Path, delay_s: float = 0.002) -> RolloutManager:
    return RolloutManager(FakeEngine(delay_s=delay_s), Durable.open(path / "b.sqlite"))


async def listed_state(mgr: RolloutManager, gid: str) -> str | None:
    return (await mgr.show_partial(gid)).state


def test_continue_keeps_generating_after_the_answer(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path)
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 300)], on_quota="continue")
        r = await mgr.rollout(req)
        assert [g.group_id for g in r.groups] == ["quick"]
        assert r.buffered_group_ids == ["long"]
        # The call has answered; the straggler goes on, listed as buffered and running.
        await until(lambda: "long" in mgr.background.running_groups())
        assert await listed_state(mgr, "long") == "running"
        assert len(mgr.buffer.idle) == 1  # still counted as buffered
        await until(lambda: not mgr.background.running_groups())
        assert await listed_state(mgr, "long") == "finished"
        (s,) = (await mgr.buffer.read_group("long")).samples
        assert s.status == "truncated" and s.output_ids == reference(300)
        # Handed over in place: the segment the call started never stopped (no snapshot, no
        # restore, no second segment).
        assert len(s.segments) == 1 and mgr.background.pauses == 0
        # The next call gets it at once, without generating anything.
        calls = len(mgr.engine.calls)  # type: ignore[attr-defined]
        r2 = await mgr.rollout(RolloutReq(groups=[], target_groups=1))
        assert [g.group_id for g in r2.groups] == ["long"]
        assert len(mgr.engine.calls) == calls  # type: ignore[attr-defined]
        mgr.check_integrity()

    asyncio.run(go())


def test_a_call_takes_over_a_group_still_generating(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.004)
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 400)], on_quota="continue")
        await mgr.rollout(req)
        await until(lambda: "long" in mgr.background.running_groups())
        await asyncio.sleep(0.2)
        # A call claims it mid-generation: its segment keeps generating, now the call's, and
        # counts toward its quota (nothing stops, nothing restores).
        r = await mgr.rollout(RolloutReq(groups=[spec("new", 500)], target_groups=1))
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
        (new,) = (await mgr.buffer.read_group("new")).samples
        assert r.stats.output_tokens == 400 + len(new.output_ids)
        assert mgr.background.tally.output_tokens == 0
        mgr.check_integrity()

    asyncio.run(go())


def test_a_call_takes_over_what_its_running_target_holds_and_the_rest_gives_way(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.003)
        await mgr.add_groups(GroupsReq(groups=[spec(f"g{i}", 300) for i in range(3)]))
        await until(lambda: len(mgr.background.running_groups()) == 3)
        await asyncio.sleep(0.05)
        req = RolloutReq(groups=[], target_groups=1, max_inflight_groups=1)
        r = await mgr.rollout(req)
        # The oldest passed to the call generating: one segment, never stopped.
        assert [g.group_id for g in r.groups] == ["g0"]
        (s,) = r.groups[0].samples
        assert len(s.segments) == 1 and s.output_ids == reference(300)
        # The two it had no room for stopped (one pause) and went on after the call.
        assert mgr.background.pauses == 1
        await until(lambda: not mgr.background.wanted and not mgr.buffer.holders)
        for gid in ("g1", "g2"):
            (x,) = (await mgr.buffer.read_group(gid)).samples
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
        persist = mgr.persister.persist
        second: list[asyncio.Task[Any]] = []

        async def persist_while_a_call_arrives(*args: Any, **kw: Any) -> None:
            if not second:
                req = RolloutReq(groups=[spec("other", 30)], target_groups=1, resume_first=False)
                second.append(asyncio.create_task(mgr.rollout(req)))
                await until(lambda: len(mgr.calls) == 2)
            await persist(*args, **kw)

        mgr.persister.persist = persist_while_a_call_arrives  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 400)], on_quota="continue")
        r = await mgr.rollout(req)
        assert r.buffered_group_ids == ["long"]
        (x,) = (await mgr.buffer.read_group("long")).samples
        assert 0 < len(x.output_ids) < 400  # stopped, and what it made is durable
        assert len(x.segments) == 1
        await second[0]
        await until(lambda: not mgr.background.wanted and not mgr.buffer.holders)
        (x,) = (await mgr.buffer.read_group("long")).samples
        assert x.output_ids == reference(400) and len(x.segments) == 2
        mgr.check_integrity()

    asyncio.run(go())


def test_a_restart_keeps_what_was_persisted(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.005)
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 480)], on_quota="continue")
        await mgr.rollout(req)
        (stored,) = mgr.store.load_all()  # what the answer acknowledged
        acknowledged = len(stored.samples[0].output_ids)
        await until(lambda: "long" in mgr.background.running_groups())
        await asyncio.sleep(0.1)
        # A crash now: the store holds what the call's answer acknowledged (the process dies
        # without handing anything back).
        mgr.store.close()
        again = make(tmp_path)
        (s,) = (await again.buffer.read_group("long")).samples
        assert s.status == "partial" and len(s.output_ids) >= acknowledged
        assert s.output_ids == reference(480)[: len(s.output_ids)]
        assert not again.background.wanted  # a restart treats them like any buffered group
        again.check_integrity()

    asyncio.run(go())


# ---- review of 2026-12-06 ------------------------------------------------------------------


def test_a_round_does_not_rewrite_the_groups_that_found_no_room(tmp_path: Path) -> None:
    """Found by review: each background round read every wanted group, started what fit, and
    persisted each of the others unchanged, one fsynced commit per group, every round (and a
    call arriving meanwhile waited for all of it)."""
    from tests.unit.buffer.test_buffer import CapacityEngine

    async def go() -> None:
        eng = CapacityEngine(max_running=2, total_tokens=100_000)  # admits 2 + a queue of 8
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b.sqlite"))
        await mgr.segments.planner.admission_ready()
        real, written = mgr.buffer.persist, []

        async def counting(put: Any, delete: Any, call: Any = None) -> None:
            written.extend(g.group_id for g in put if not any(s.output_ids for s in g.samples))
            await real(put, delete, call)

        groups = [spec(f"g{i}", 40) for i in range(20)]
        await mgr.add_groups(GroupsReq(groups=groups))  # the new groups' own first write
        mgr.buffer.persist = counting  # type: ignore[method-assign]
        await until(lambda: all(mgr.buffer.idle.get(f"g{i}").unfinished == 0 for i in range(20)))
        await until(lambda: not mgr.background.running_groups())
        assert written == []  # before the fix: every group that waited, once per round
        for i in range(20):
            assert len((await mgr.buffer.read_group(f"g{i}")).samples[0].output_ids) == 40
        mgr.check_integrity()

    asyncio.run(go())


def test_a_store_that_fails_leaves_no_group_held_by_the_background(tmp_path: Path) -> None:
    """Found by review: a background round whose commit failed tried to hand its groups back
    with another commit; when that failed too, they stayed held by the background for the
    server's life (409 group_busy for every call, resume and delete naming them)."""

    async def go() -> None:
        mgr = make(tmp_path)
        await mgr.add_groups(GroupsReq(groups=[spec("a", 200), spec("b", 200)]))
        await until(lambda: mgr.background.running_groups() == {"a", "b"})
        real = mgr.buffer.persist

        async def full_disk(*args: Any) -> None:
            raise OSError(28, "No space left on device")

        mgr.buffer.persist = full_disk  # type: ignore[method-assign]
        await until(lambda: not mgr.background.running_groups())
        assert mgr.buffer.owner_of("a") is None and mgr.buffer.owner_of("b") is None
        mgr.buffer.persist = real  # type: ignore[method-assign]
        r = await mgr.rollout(RolloutReq(groups=[], target_groups=2))  # the disk is back
        assert sorted(g.group_id for g in r.groups) == ["a", "b"]
        assert all(g.samples[0].output_ids == reference(200) for g in r.groups)
        mgr.check_integrity()

    asyncio.run(go())


def test_a_group_handed_on_generating_is_stored_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a `continue` call persists its stragglers while they go on generating,
    and the store's thread summarized a group, then encoded its body later: a segment that
    ended in between left a row whose summary and body disagree (or a body caught half-way
    through recording the segment), there to be read after a crash. The store thread is
    slowed between the two here so that the straggler's segment ends inside the window."""
    import threading

    import april_server.buffer.store as store_mod
    from april_server.buffer.buffer_index import summarize

    real_encode = store_mod.encode_group

    def slow_on_the_store_thread(g: Any) -> bytes:
        if threading.current_thread() is not threading.main_thread():
            import time

            time.sleep(0.3)  # the loop records the straggler's end meanwhile
        return real_encode(g)

    monkeypatch.setattr(store_mod, "encode_group", slow_on_the_store_thread)

    async def go() -> None:
        mgr = make(tmp_path)
        torn: list[str] = []
        real_commit = mgr.store.commit

        async def checked(*args: Any) -> Any:
            out = await real_commit(*args)
            bodies = await mgr.store.read_groups([e.group_id for e in mgr.store.load_index()])
            for e in mgr.store.load_index():
                if summarize(bodies[e.group_id], e.seq) != e:
                    torn.append(e.group_id)
            return out

        mgr.store.commit = checked  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 60)], on_quota="continue")
        r = await mgr.rollout(req)
        assert r.buffered_group_ids == ["long"]
        await until(lambda: not mgr.background.running_groups())
        assert torn == []  # before the fix: ["long"], after the call's own commit
        (s,) = (await mgr.buffer.read_group("long")).samples
        assert s.output_ids == reference(60)
        mgr.check_integrity()

    asyncio.run(go())


def test_groups_handed_in_while_a_round_runs_start_once_it_ends(tmp_path: Path) -> None:
    """Found by the simulator (seed 17, faults off): groups handed in while a background
    round ran waited for "a later round", but the round ended without starting one, and
    nothing else came to kick the background: they stayed idle until the next call."""

    async def go() -> None:
        mgr = make(tmp_path)
        await mgr.add_groups(GroupsReq(groups=[spec("a", 400)]))  # outlasts b's durable commit
        await until(lambda: mgr.background.running_groups() == {"a"})
        await mgr.add_groups(GroupsReq(groups=[spec("b", 5)]))  # while "a"'s round runs
        assert mgr.background.running_groups() == {"a"}  # not beside it: in the next round
        await until(lambda: mgr.buffer.idle.get("b").unfinished == 0, timeout=10.0)
        (s,) = (await mgr.buffer.read_group("b")).samples
        assert s.output_ids == reference(5)
        mgr.check_integrity()

    asyncio.run(go())
