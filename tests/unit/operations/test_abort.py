"""`POST /abort` (`operations/abort.py`): idempotent, it stops what generates with the `keep`
asked for, a call waiting for answers ends and leaves them awaiting, and what a call or a hand-in
left in the background stops for good. Fake engine (its tokens are a hash of the context)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from april_client.protocol import (
    AbortReq,
    GroupsReq,
    InputReq,
    RolloutReq,
    SampleAwaitingEvent,
    StreamEvent,
)
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from tests.unit.calls.test_rollout import make as in_memory_manager
from tests.unit.calls.test_rollout import spec as budgets_spec
from tests.unit.calls.test_turns_in_call import answer, drive
from tests.unit.calls.test_turns_in_call import spec as agent_spec
from tests.unit.fake_engine import SnapshotFakeEngine
from tests.unit.runtime.test_background import listed_state, make, reference, spec, until


def test_abort_is_idempotent_and_waits_for_idle() -> None:
    async def go() -> None:
        mgr = in_memory_manager()
        call = asyncio.ensure_future(
            mgr.rollout(RolloutReq(groups=[budgets_spec("a", 2, [500, 500])], target_groups=1))
        )
        await asyncio.sleep(0.05)
        first = await mgr.abort(AbortReq(all=True))
        assert not mgr.segments.running and not mgr.engine.active  # type: ignore[attr-defined]
        assert {s.sample_id for s in first.samples} == {"a/0", "a/1"}
        second = await mgr.abort(AbortReq(all=True))
        assert second.samples == []
        resp = await call
        assert resp.groups == [] and not resp.stats.quota_met
        assert resp.buffered_group_ids == ["a"]
        assert all(0 < len(s.output_ids) < 500 for s in (await mgr.buffer.read_group("a")).samples)
        mgr.check_integrity()

    asyncio.run(go())


def test_an_abort_ends_a_call_waiting_for_answers_and_keeps_them_awaiting(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr = make(tmp_path)
        req = RolloutReq(groups=[agent_spec("a")], target_groups=1, stream=True)

        async def abort_instead(ev: StreamEvent) -> bool:
            if isinstance(ev, SampleAwaitingEvent):
                await mgr.abort(AbortReq(all=True))
            return False

        resp, seen = await asyncio.wait_for(drive(mgr, req, abort_instead), 30)
        assert resp.groups == [] and resp.buffered_group_ids == ["a"]
        (s,) = (await mgr.buffer.read_group("a")).samples
        assert s.status == "awaiting_input"
        await mgr.post_input("a/0", InputReq(append_ids=answer(1)))  # kept, waits idle
        mgr.check_integrity()

    asyncio.run(go())


def test_an_abort_while_a_continue_call_persists_keeps_what_it_asked_for(tmp_path: Path) -> None:
    """An abort (keep: tokens) arrives while the call persists its answer: the straggler is
    the abort's, not handed over; it stops for good with its tokens, persisted."""

    async def go() -> None:
        eng = SnapshotFakeEngine(delay_s=0.003)
        mgr = RolloutManager(eng, Durable.open(tmp_path / "b"))
        persist = mgr.persister.persist
        aborts: list[asyncio.Task[Any]] = []

        async def persist_while_aborted(*args: Any, **kw: Any) -> None:
            if not aborts:
                aborts.append(asyncio.create_task(mgr.abort(AbortReq(all=True, keep="tokens"))))
                stopping = lambda: any(r.stopping for r in mgr.segments.running.values())  # noqa: E731
                await until(lambda: aborts[0].done() or stopping())
            await persist(*args, **kw)

        mgr.persister.persist = persist_while_aborted  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("quick", 3), spec("long", 400)], on_quota="continue")
        r = await mgr.rollout(req)
        assert r.buffered_group_ids == ["long"]
        await aborts[0]
        (x,) = (await mgr.buffer.read_group("long")).samples
        assert 0 < len(x.output_ids) < 400 and x.status == "partial"
        assert x.output_ids == reference(400)[: len(x.output_ids)]
        # The abort's keep (tokens), not the snapshot the call's stop would have taken.
        assert x.snapshot_bytes == 0 and not eng.snaps
        await asyncio.sleep(0.1)
        assert not mgr.segments.running and not mgr.background.wanted
        assert await listed_state(mgr, "long") == "idle"
        mgr.check_integrity()

    asyncio.run(go())


def test_abort_and_delete_stop_background_samples_for_good(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.005)
        await mgr.add_groups(GroupsReq(groups=[spec("a", 450), spec("d", 450)]))
        await until(lambda: len(mgr.background.running_groups()) == 2)
        await asyncio.sleep(0.1)
        await mgr.delete("d")
        assert not mgr.buffer.known("d")
        out = await mgr.abort(AbortReq(all=True, keep="tokens"))
        assert [s.sample_id for s in out.samples] == ["a/0"]
        assert 0 < len(out.samples[0].output_ids) < 450
        await asyncio.sleep(0.2)
        assert not mgr.segments.running and not mgr.background.wanted  # not restarted later
        r = await mgr.rollout(RolloutReq(groups=[spec("x", 2)], target_groups=1))
        await asyncio.sleep(0.1)
        assert [g.group_id for g in r.groups] == ["x"] and not mgr.segments.running
        mgr.check_integrity()

    asyncio.run(go())


def test_aborting_a_finished_call_stops_what_it_left_in_the_background(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.005)
        req = RolloutReq(groups=[spec("q", 3), spec("left", 450)], on_quota="continue")
        r = await mgr.rollout(req)
        await until(lambda: "left" in mgr.background.running_groups())
        out = await mgr.abort(AbortReq(batch_id=r.batch_id, keep="tokens"))
        assert [s.sample_id for s in out.samples] == ["left/0"]
        await asyncio.sleep(0.1)
        assert not mgr.segments.running and not mgr.background.wanted
        mgr.check_integrity()

    asyncio.run(go())
