"""A call gives back every group it held, whole (`rollout.py`, `wind_down.py`): when its client
leaves (while it claims buffered groups, or right after its stream started), when it fails, when
it delivered nothing (a `drop` call's stragglers, the groups its trainer rejected stay for the
retry), and when groups finish between the quota and the wind-down. A group being claimed stays
known, and an answer already made durable is still given. Fake engine, real SQLite."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from april_client.protocol import GroupsReq, RejectReq, RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import FakeEngine
from tests.unit.group_specs import buffered, spec
from tests.unit.waiting import until


def test_a_call_cancelled_while_claiming_buffered_groups_keeps_them(tmp_path: Path) -> None:
    """The black-box trigger: a call whose client leaves while it reads buffered bodies."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.001), Durable.open(tmp_path / "b.sqlite"))
        await buffered(mgr, ["g1", "g2"])
        gate = threading.Event()
        mgr.store._db.submit(lambda db: gate.wait(), write=False)  # reads queue behind it
        call = asyncio.ensure_future(
            mgr.rollout(RolloutReq(groups=[spec("new", 5)], target_groups=1))
        )
        await asyncio.sleep(0.05)  # the call is awaiting the bodies of g1, g2
        call.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        # Everything is back, and the server still answers.
        idle = {e.group_id for e in mgr.buffer.idle.oldest()}
        assert idle == {"g1", "g2", "new"}
        r = await asyncio.wait_for(
            mgr.rollout(RolloutReq(groups=[], target_groups=3, on_quota="tokens")), 30
        )
        assert sorted(g.group_id for g in r.groups) == ["g1", "g2", "new"]
        mgr.check_integrity()

    asyncio.run(go())


def test_a_group_being_claimed_is_still_known(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.001), Durable.open(tmp_path / "b.sqlite"))
        await buffered(mgr, ["g1"])
        gate = threading.Event()
        mgr.store._db.submit(lambda db: gate.wait(), write=False)
        first = asyncio.ensure_future(
            mgr.rollout(RolloutReq(groups=[], target_groups=1, on_quota="tokens"))
        )
        await asyncio.sleep(0.05)  # `first` is reading g1's body: g1 is in neither place
        assert mgr.buffer.known("g1")
        with pytest.raises(ApiError) as err:
            await mgr.rollout(RolloutReq(groups=[spec("g1", 5)], target_groups=1))
        assert err.value.status == 409
        gate.set()
        r = await first
        assert [g.group_id for g in r.groups] == ["g1"]
        assert len(r.groups[0].samples[0].output_ids) == 200
        mgr.check_integrity()

    asyncio.run(go())


def test_an_unexpected_error_in_a_call_puts_its_groups_back_intact(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        await buffered(mgr, ["old"], budget=300)
        before = len((await mgr.buffer.read_group("old")).samples[0].output_ids)
        req = RolloutReq(groups=[spec("new", 300)], target_groups=2, on_quota="tokens")
        call = asyncio.ensure_future(mgr.rollout(req))
        await until(lambda: len(mgr.calls) == 1 and {"old/0", "new/0"} <= set(mgr.segments.running))
        await asyncio.sleep(0.1)  # some tokens made by both
        (running,) = mgr.calls.values()

        def broken(*args: Any, **kwargs: Any) -> None:
            raise KeyError("a bug")

        running.refill.collect = broken  # type: ignore[method-assign]  # the next segment that ends hits a bug
        mgr.engine.aborted.add(mgr.segments.running["old/0"].rid)  # type: ignore[attr-defined]
        with pytest.raises(KeyError):
            await call
        # Nothing generating, nothing lost: both groups are buffered with their tokens.
        assert not mgr.segments.running
        assert {e.group_id for e in mgr.buffer.idle.oldest()} == {"old", "new"}
        assert len((await mgr.buffer.read_group("old")).samples[0].output_ids) >= before
        assert (await mgr.buffer.read_group("new")).samples[0].output_ids
        mgr.check_integrity()

    asyncio.run(go())


def test_a_reject_race_loses_no_group(tmp_path: Path) -> None:
    """Groups that finish after the quota was met (during a streamed call's reject grace, or
    while the wind-down aborts) are buffered whole, never lost, never returned twice."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.001), Durable.open(tmp_path / "b.sqlite"))
        events: asyncio.Queue[Any] = asyncio.Queue()
        groups = [spec(f"g{i}", 20 + 5 * i) for i in range(6)]
        req = RolloutReq(groups=groups, target_groups=2, stream=True, reject_grace_s=0.3)
        call = asyncio.ensure_future(mgr.rollout(req, events))
        first = await events.get()
        (call_obj,) = mgr.calls.values()
        call_obj.reject(RejectReq(group_ids=[first.group.group_id]))
        r = await call
        returned = {g.group_id for g in r.groups}
        assert len(returned) == 2 and first.group.group_id not in returned
        left = {e.group_id for e in mgr.buffer.idle.oldest()}
        assert returned | left | set(r.dropped_group_ids) == {g.group_id for g in groups}
        assert not returned & left
        mgr.check_integrity()

    asyncio.run(go())


def test_a_stream_cancelled_right_after_it_started_keeps_its_groups(tmp_path: Path) -> None:
    """Found by `make chaos` (10 min, server): a streamed call answers 200 once its groups are
    adopted, then sizes its running set (`auto` reads the engine's step curve; admission may ask
    the engine's capacity). A client that left during those awaits cancelled the call before
    its wind-down could run: the groups it had adopted, never made durable, were forgotten,
    and a retry of its request_id found no record of them."""

    async def go() -> None:
        path = tmp_path / "b.sqlite"
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(path))
        gate = asyncio.Event()
        real = mgr.segments.planner.admission_ready

        async def slow_admission() -> Any:
            await gate.wait()  # e.g. the engine busy answering a control message
            return await real()

        mgr.segments.planner.admission_ready = slow_admission  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("a", 50)], target_groups=1, stream=True, request_id="s-1")
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(mgr.rollout(req, asyncio.Queue(), ready))
        await asyncio.wait_for(ready, 5)  # the stream has started: "a" is acknowledged
        await asyncio.sleep(0.01)
        call.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await call
        assert [e.group_id for e in mgr.buffer.idle.oldest()] == ["a"]
        mgr.check_integrity()
        mgr.store.close()
        # Durable, with the attempt's record: after a restart a retry runs again on "a".
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(path))
        r = await mgr.rollout(msgspec.structs.replace(req, stream=False))
        assert [g.group_id for g in r.groups] == ["a"]
        assert len(r.groups[0].samples[0].output_ids) == 50

    asyncio.run(go())


def test_an_undelivered_drop_call_keeps_its_stragglers_for_the_retry(tmp_path: Path) -> None:
    """`drop` discards a delivered call's stragglers. A call that delivered nothing (its client
    left, or it failed) must give every group back: before the fix it deleted its started,
    unfinished groups durably, and the retry of its request_id could not find them."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        groups = [spec("fast", 2), spec("slow", 400)]
        req = RolloutReq(groups=groups, target_groups=2, on_quota="drop", request_id="eval-3")
        first = asyncio.ensure_future(mgr.rollout(req))
        # "fast" finished, "slow" generates: a straggler to drop
        await until(
            lambda: "slow/0" in mgr.segments.running and "fast/0" not in mgr.segments.running
        )
        assert "slow/0" in mgr.segments.running and "fast/0" not in mgr.segments.running
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert {e.group_id for e in mgr.buffer.idle.oldest()} == {"fast", "slow"}
        r = await mgr.rollout(req)  # the retry runs again on both
        assert sorted(g.group_id for g in r.groups) == ["fast", "slow"]
        assert len(r.groups[1].samples[0].output_ids) == 400
        assert r.dropped_group_ids == []
        mgr.check_integrity()

    asyncio.run(go())


def test_an_undelivered_call_gives_back_the_groups_its_trainer_rejected(tmp_path: Path) -> None:
    """A streamed call whose client rejected a group and then left delivered nothing: the
    rejected group goes back to the buffer with the rest (docs/operations.md: every group it
    held goes back), and the retry sees it again."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        events: asyncio.Queue[Any] = asyncio.Queue()
        req = RolloutReq(
            groups=[spec("a", 2), spec("b", 400)],
            target_groups=1,
            stream=True,
            reject_grace_s=5.0,
            request_id="s-9",
        )
        call = asyncio.ensure_future(mgr.rollout(req, events))
        first = await events.get()
        (call_obj,) = mgr.calls.values()
        call_obj.reject(RejectReq(group_ids=[first.group.group_id]))  # "b" must finish now
        await asyncio.sleep(0.02)
        assert "b/0" in mgr.segments.running
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert {e.group_id for e in mgr.buffer.idle.oldest()} == {"a", "b"}
        mgr.check_integrity()

    asyncio.run(go())


def test_a_failure_after_the_answer_was_made_durable_still_answers(tmp_path: Path) -> None:
    """Found by review: a `continue` call whose stragglers the background could not take
    stops them and persists them again, after its answer (the returned groups' deletion and
    its response) was committed. When that second commit failed, the caller got a 500 for a
    delivery that had happened: without a request_id, the returned groups were gone."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        mgr.background.adopt = lambda owner, going: list(going)  # type: ignore[method-assign]
        real, commits = mgr.buffer.persist, [0]

        async def second_fails(*args: Any) -> None:
            commits[0] += 1
            if commits[0] == 2:
                raise OSError(28, "No space left on device")
            await real(*args)

        mgr.buffer.persist = second_fails  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 400)], on_quota="continue")
        r = await mgr.rollout(req)  # before the fix: raised
        assert [g.group_id for g in r.groups] == ["quick"] and r.buffered_group_ids == ["long"]
        assert [e.group_id for e in mgr.buffer.idle.oldest()] == ["long"]
        assert mgr.buffer.owner_of("long") is None
        mgr.buffer.persist = real  # type: ignore[method-assign]
        r2 = await mgr.rollout(RolloutReq(groups=[], target_groups=1))
        assert len(r2.groups[0].samples[0].output_ids) == 400
        mgr.check_integrity()

    asyncio.run(go())


def test_a_continue_call_whose_answer_fails_to_persist_leaves_nothing_generating(
    tmp_path: Path,
) -> None:
    """Found by the simulator (seed 15 with faults: a commit failing like a full disk): a
    `continue` call whose own commit failed raised with its stragglers still generating in
    place, meant for the background, and gave their groups back as last persisted while their
    segments went on recording into bodies nobody held (a sample running for nobody)."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        await mgr.add_groups(GroupsReq(groups=[spec("long", 400)], start="idle"))
        real = mgr.buffer.persist

        async def full_disk(*args: Any) -> None:
            raise OSError(28, "No space left on device")

        mgr.buffer.persist = full_disk  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("quick", 2)], target_groups=1, on_quota="continue")
        with pytest.raises(OSError):
            await mgr.rollout(req)
        assert not mgr.segments.running  # before the fix: long/0, for a call that had ended
        assert mgr.buffer.owner_of("long") is None
        mgr.check_integrity()
        mgr.buffer.persist = real  # type: ignore[method-assign]
        r = await mgr.rollout(RolloutReq(groups=[], target_groups=1))
        assert r.groups[0].group_id == "long"
        assert len(r.groups[0].samples[0].output_ids) == 400
        mgr.check_integrity()

    asyncio.run(go())
