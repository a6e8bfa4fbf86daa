"""Regressions of the review defects (issue #23) on the single-server bookkeeping: each test
failed on the code before its fix. Fake engine, real SQLite."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from april_client.protocol import GroupSpec, RejectReq, RolloutReq
from april_server.buffer.store import BufferStore
from april_server.calls.rollout import rollout
from april_server.runtime.manager import RolloutManager
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import FakeEngine, SnapshotFakeEngine

NO_EOS = {"ignore_eos": True, "temperature": 0.0}


def spec(gid: str, budget: int, n: int = 1) -> GroupSpec:
    return GroupSpec(
        gid, n=n, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": budget, **NO_EOS}
    )


async def buffered(mgr: RolloutManager, gids: list[str], budget: int = 200) -> None:
    """Leave `gids` idle in the buffer, each with a partial output (a call met its quota
    on a short group and interrupted them)."""
    groups = [spec("quick", 2)] + [spec(g, budget) for g in gids]
    await rollout(mgr, RolloutReq(groups=groups, target_groups=1, on_quota="tokens"))
    assert {e.group_id for e in mgr.buffer.idle.oldest()} == set(gids)


# ---- 1: a cancelled store read must not kill the store thread ---------------------------------


def test_a_cancelled_read_leaves_the_store_thread_serving(tmp_path: Path) -> None:
    st = BufferStore(tmp_path / "b.sqlite")
    gate = threading.Event()
    st._db.submit(lambda db: gate.wait(), write=False)  # the thread is busy: reads queue up

    async def go() -> None:
        read = asyncio.ensure_future(st.read_groups(["x"]))
        await asyncio.sleep(0.01)
        read.cancel()  # its caller went away (a streamed call whose client disconnected)
        await asyncio.sleep(0.01)
        gate.set()
        # The thread must still answer: before the fix it died on the cancelled future.
        assert await asyncio.wait_for(st.load_call("nope"), 5.0) is None
        await asyncio.wait_for(st.commit([], [], ("r1", b"{}")), 5.0)
        assert await asyncio.wait_for(st.load_call("r1"), 5.0) == b"{}"

    asyncio.run(go())
    assert st._db._thread.is_alive()


def test_a_cancelled_commit_still_lands_and_the_thread_survives(tmp_path: Path) -> None:
    st = BufferStore(tmp_path / "b.sqlite")
    gate = threading.Event()
    st._db.submit(lambda db: gate.wait(), write=False)

    async def go() -> None:
        commit = asyncio.ensure_future(st.commit([], [], ("r2", b"{}")))
        await asyncio.sleep(0.01)
        commit.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        # The caller's memory may already count on the write: it lands all the same.
        assert await asyncio.wait_for(st.load_call("r2"), 5.0) == b"{}"

    asyncio.run(go())
    assert st._db._thread.is_alive()


def test_a_call_cancelled_while_claiming_buffered_groups_keeps_them(tmp_path: Path) -> None:
    """The black-box trigger: a call whose client leaves while it reads buffered bodies."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.001), BufferStore(tmp_path / "b.sqlite"))
        await buffered(mgr, ["g1", "g2"])
        gate = threading.Event()
        mgr.store._db.submit(lambda db: gate.wait(), write=False)  # reads queue behind it
        call = asyncio.ensure_future(
            rollout(mgr, RolloutReq(groups=[spec("new", 5)], target_groups=1))
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
            rollout(mgr, RolloutReq(groups=[], target_groups=3, on_quota="tokens")), 30
        )
        assert sorted(g.group_id for g in r.groups) == ["g1", "g2", "new"]
        mgr.check_integrity()

    asyncio.run(go())


# ---- 2: a group being claimed is known; a failing call releases its groups intact -------------


def test_a_group_being_claimed_is_still_known(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.001), BufferStore(tmp_path / "b.sqlite"))
        await buffered(mgr, ["g1"])
        gate = threading.Event()
        mgr.store._db.submit(lambda db: gate.wait(), write=False)
        first = asyncio.ensure_future(
            rollout(mgr, RolloutReq(groups=[], target_groups=1, on_quota="tokens"))
        )
        await asyncio.sleep(0.05)  # `first` is reading g1's body: g1 is in neither place
        assert mgr.buffer.known("g1")
        with pytest.raises(ApiError) as err:
            await rollout(mgr, RolloutReq(groups=[spec("g1", 5)], target_groups=1))
        assert err.value.status == 409
        gate.set()
        r = await first
        assert [g.group_id for g in r.groups] == ["g1"]
        assert len(r.groups[0].samples[0].output_ids) == 200
        mgr.check_integrity()

    asyncio.run(go())


def test_an_unexpected_error_in_a_call_puts_its_groups_back_intact(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        await buffered(mgr, ["old"], budget=300)
        before = len((await mgr.read_group("old")).samples[0].output_ids)
        req = RolloutReq(groups=[spec("new", 300)], target_groups=2, on_quota="tokens")
        call = asyncio.ensure_future(rollout(mgr, req))
        await asyncio.sleep(0.1)
        (running,) = mgr.calls.values()

        def broken(*args: Any, **kwargs: Any) -> None:
            raise KeyError("a bug")

        running._collect = broken  # the next segment that ends hits a bug in the call
        mgr.engine.aborted.add(mgr.running["old/0"].rid)  # type: ignore[attr-defined]
        with pytest.raises(KeyError):
            await call
        # Nothing generating, nothing lost: both groups are buffered with their tokens.
        assert not mgr.running
        assert {e.group_id for e in mgr.buffer.idle.oldest()} == {"old", "new"}
        assert len((await mgr.read_group("old")).samples[0].output_ids) >= before
        assert (await mgr.read_group("new")).samples[0].output_ids
        mgr.check_integrity()

    asyncio.run(go())


# ---- 3: request_id retry after a cancelled call ---------------------------------------------


def test_a_retry_after_a_cancelled_call_runs_again(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        req = RolloutReq(
            groups=[spec("a", 400), spec("b", 400)], target_groups=1, request_id="step-7"
        )
        first = asyncio.ensure_future(rollout(mgr, req))
        await asyncio.sleep(0.1)
        # A retry sent while the first attempt winds down waits for it, then runs itself.
        early = asyncio.ensure_future(rollout(mgr, req))
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
        assert await rollout(mgr, req) == r
        assert len(mgr.engine.calls) == calls  # type: ignore[attr-defined]
        mgr.check_integrity()

    asyncio.run(go())


def test_a_retry_after_the_cancelled_call_ended_claims_its_groups(tmp_path: Path) -> None:
    async def go() -> None:
        path = tmp_path / "b.sqlite"
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(path))
        req = RolloutReq(
            groups=[spec("a", 300), spec("b", 300)], target_groups=2, request_id="step-8"
        )
        first = asyncio.ensure_future(rollout(mgr, req))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert {e.group_id for e in mgr.buffer.idle.oldest()} == {"a", "b"}
        # Even after a restart: the attempt is remembered with the buffer, durably.
        mgr.store.close()
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(path))
        r = await rollout(mgr, req)  # before the fix: 409 group_exists
        assert sorted(g.group_id for g in r.groups) == ["a", "b"]
        assert all(len(g.samples[0].output_ids) == 300 for g in r.groups)
        assert await rollout(mgr, req) == r
        mgr.check_integrity()

    asyncio.run(go())


def test_a_retry_does_not_recreate_a_group_another_call_delivered(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        req = RolloutReq(
            groups=[spec("a", 300), spec("b", 300)], target_groups=1, request_id="step-9"
        )
        first = asyncio.ensure_future(rollout(mgr, req))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        other = await rollout(mgr, RolloutReq(groups=[], target_groups=1, on_quota="tokens"))
        (taken,) = [g.group_id for g in other.groups]
        r = await rollout(mgr, req)
        assert [g.group_id for g in r.groups] == [({"a", "b"} - {taken}).pop()]
        assert not len(mgr.buffer.idle)
        mgr.check_integrity()

    asyncio.run(go())


# ---- suspected: a group finishing between the quota and the wind-down --------------------------


def test_a_reject_race_loses_no_group(tmp_path: Path) -> None:
    """Groups that finish after the quota was met (during a streamed call's reject grace, or
    while the wind-down aborts) are buffered whole, never lost, never returned twice."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.001), BufferStore(tmp_path / "b.sqlite"))
        events: asyncio.Queue[Any] = asyncio.Queue()
        groups = [spec(f"g{i}", 20 + 5 * i) for i in range(6)]
        req = RolloutReq(groups=groups, target_groups=2, stream=True, reject_grace_s=0.3)
        call = asyncio.ensure_future(rollout(mgr, req, events))
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


# ---- 8: a staleness restart frees the snapshot it makes useless ------------------------------


def test_a_staleness_restart_frees_the_snapshot(tmp_path: Path) -> None:
    async def go() -> None:
        eng = SnapshotFakeEngine()
        mgr = RolloutManager(eng, BufferStore(tmp_path / "b.sqlite"))
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 400)], on_quota="snapshot")
        await rollout(mgr, req)
        assert eng.snaps == {"long/0"}
        eng.version = "2"  # two weight updates later: too stale for max_staleness=1
        call = asyncio.ensure_future(
            rollout(mgr, RolloutReq(groups=[], target_groups=1, max_staleness=1))
        )
        await asyncio.sleep(0.1)
        assert mgr.running["long/0"].sample.output_ids == []  # restarted from its prompt
        assert mgr.counters.staleness_restarts == 1
        assert eng.snaps == set()  # before the fix: held until the sample left the server
        await call
        mgr.check_integrity()

    asyncio.run(go())


# ---- 10: a restore that made nothing visible still frees the snapshot ------------------------


def test_a_restore_that_restored_nothing_does_not_leak_the_snapshot(tmp_path: Path) -> None:
    """The fake's restore makes nothing visible (as after an eviction of its pages, no free
    slots, or a late answer), yet the store still holds the snapshot: the segment that tried
    it must free it, or its bytes stay held after the buffer drained (#23 item 10)."""

    async def go() -> None:
        eng = SnapshotFakeEngine()
        mgr = RolloutManager(eng, BufferStore(tmp_path / "b.sqlite"))
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 300)], on_quota="snapshot")
        await rollout(mgr, req)
        assert eng.snaps == {"long/0"}
        r = await rollout(mgr, RolloutReq(groups=[], target_groups=1))  # restore planned
        assert [g.group_id for g in r.groups] == ["long"]
        assert eng.snaps == set()  # before the fix: {"long/0"}, with nothing pointing at it
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
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(path))
        gate = asyncio.Event()
        real = mgr.admission_ready

        async def slow_admission() -> Any:
            await gate.wait()  # e.g. the engine busy answering a control message
            return await real()

        mgr.admission_ready = slow_admission  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("a", 50)], target_groups=1, stream=True, request_id="s-1")
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(rollout(mgr, req, asyncio.Queue(), ready))
        await asyncio.wait_for(ready, 5)  # the stream has started: "a" is acknowledged
        await asyncio.sleep(0.01)
        call.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await call
        assert [e.group_id for e in mgr.buffer.idle.oldest()] == ["a"]
        mgr.check_integrity()
        mgr.store.close()
        # Durable, with the attempt's record: after a restart a retry runs again on "a".
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(path))
        r = await rollout(mgr, msgspec.structs.replace(req, stream=False))
        assert [g.group_id for g in r.groups] == ["a"]
        assert len(r.groups[0].samples[0].output_ids) == 50

    asyncio.run(go())


# ---- review of 2026-12-06: an undelivered `drop` call drops nothing ----------------------------


def test_an_undelivered_drop_call_keeps_its_stragglers_for_the_retry(tmp_path: Path) -> None:
    """`drop` discards a delivered call's stragglers. A call that delivered nothing (its client
    left, or it failed) must give every group back: before the fix it deleted its started,
    unfinished groups durably, and the retry of its request_id could not find them."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        groups = [spec("fast", 2), spec("slow", 400)]
        req = RolloutReq(groups=groups, target_groups=2, on_quota="drop", request_id="eval-3")
        first = asyncio.ensure_future(rollout(mgr, req))
        await asyncio.sleep(0.1)  # "fast" finished, "slow" generates: a straggler to drop
        assert "slow/0" in mgr.running and "fast/0" not in mgr.running
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert {e.group_id for e in mgr.buffer.idle.oldest()} == {"fast", "slow"}
        r = await rollout(mgr, req)  # the retry runs again on both
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
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        events: asyncio.Queue[Any] = asyncio.Queue()
        req = RolloutReq(
            groups=[spec("a", 2), spec("b", 400)], target_groups=1, stream=True,
            reject_grace_s=5.0, request_id="s-9",
        )  # fmt: skip
        call = asyncio.ensure_future(rollout(mgr, req, events))
        first = await events.get()
        (call_obj,) = mgr.calls.values()
        call_obj.reject(RejectReq(group_ids=[first.group.group_id]))  # "b" must finish now
        await asyncio.sleep(0.02)
        assert "b/0" in mgr.running
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert {e.group_id for e in mgr.buffer.idle.oldest()} == {"a", "b"}
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
    from april_server.operations.resume import resume
    from april_server.rules.placement import Slot

    monkeypatch.setattr(segments_mod, "ENGINE_WAIT_S", 0.2)
    monkeypatch.setattr(segments_mod, "HEALTH_POLL_S", 0.02)

    class Unreachable(SnapshotFakeEngine):
        down = False

        def healthy(self, slot: Slot) -> bool:
            return not self.down

    async def go() -> None:
        eng = Unreachable()
        mgr = RolloutManager(eng, BufferStore(tmp_path / "b.sqlite"))
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 400)], on_quota="snapshot")
        await rollout(mgr, req)
        assert eng.snaps == {"long/0"}
        eng.down = True
        (s,) = await resume(mgr, ResumeReq(sample_ids=["long/0"]))  # nowhere to run
        assert s.status == "partial" and s.snapshot_bytes > 0
        assert eng.snaps == {"long/0"}  # before the fix: set(), the figures still set
        mgr.check_integrity()

    asyncio.run(go())


def test_a_failure_after_the_answer_was_made_durable_still_answers(tmp_path: Path) -> None:
    """Found by review: a `continue` call whose stragglers the background could not take
    stops them and persists them again, after its answer (the returned groups' deletion and
    its response) was committed. When that second commit failed, the caller got a 500 for a
    delivery that had happened: without a request_id, the returned groups were gone."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        mgr.background.adopt = lambda owner, going: list(going)  # type: ignore[method-assign]
        real, commits = mgr.buffer.persist, [0]

        async def second_fails(*args: Any) -> None:
            commits[0] += 1
            if commits[0] == 2:
                raise OSError(28, "No space left on device")
            await real(*args)

        mgr.buffer.persist = second_fails  # type: ignore[method-assign]
        req = RolloutReq(groups=[spec("quick", 2), spec("long", 400)], on_quota="continue")
        r = await rollout(mgr, req)  # before the fix: raised
        assert [g.group_id for g in r.groups] == ["quick"] and r.buffered_group_ids == ["long"]
        assert [e.group_id for e in mgr.buffer.idle.oldest()] == ["long"]
        assert mgr.buffer.owner_of("long") is None
        mgr.buffer.persist = real  # type: ignore[method-assign]
        r2 = await rollout(mgr, RolloutReq(groups=[], target_groups=1))
        assert len(r2.groups[0].samples[0].output_ids) == 400
        mgr.check_integrity()

    asyncio.run(go())


def test_an_unexpected_error_in_a_segment_leaves_the_sample_free_to_run(tmp_path: Path) -> None:
    """Found by review: an exception out of a segment's task (an engine's malformed answer
    decoded while settling a weight update's cut) skipped taking the sample out of
    `running`: every later start refused it as still generating, for the server's life. Now
    it is logged, and the sample keeps what it had, as after an engine error."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        real = mgr.segments._one_segment
        failures = [1]

        async def malformed_once(*args: Any) -> Any:
            if failures[0]:
                failures[0] -= 1
                raise ValueError("malformed /kv answer")
            return await real(*args)

        mgr.segments._one_segment = malformed_once  # type: ignore[method-assign]
        first = await rollout(mgr, RolloutReq(groups=[spec("a", 20)], target_groups=1))
        assert not first.stats.quota_met and first.buffered_group_ids == ["a"]
        assert "a/0" not in mgr.running  # before the fix: held there for good
        r = await rollout(mgr, RolloutReq(groups=[], target_groups=1))
        assert [g.group_id for g in r.groups] == ["a"]
        assert len(r.groups[0].samples[0].output_ids) == 20
        mgr.check_integrity()

    asyncio.run(go())


def test_a_sample_id_names_one_member_in_one_spelling(tmp_path: Path) -> None:
    """Found by review: indexes were read with `isdigit()` and `int()`, so "g/01" aliased
    "g/1" (a resume naming both started the member, then failed on its alias and released
    the group while the segment kept generating; an abort of "g/01" stopped nothing) and
    "g/²" crashed with a 500 after an abort had already acted. Now both are 404."""
    from april_client.protocol import AbortReq, InputReq, ResumeReq
    from april_server.operations.abort import abort
    from april_server.operations.inputs import post_input
    from april_server.operations.resume import resume
    from april_server.wire.ids import split_sample_id

    assert split_sample_id("g/0") == ("g", 0) and split_sample_id("a/b/12") == ("a/b", 12)
    assert [split_sample_id(s) for s in ("g/01", "g/²", "g/", "g", "/1", "g/-1")] == [None] * 6

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        await buffered(mgr, ["g"])
        for bad in (["g/0", "g/00"], ["g/²"]):
            with pytest.raises(ApiError) as exc:
                await resume(mgr, ResumeReq(sample_ids=bad))
            assert exc.value.status == 404, bad
        with pytest.raises(ApiError) as exc:
            await abort(mgr, AbortReq(sample_ids=["g/²"]))
        assert exc.value.status == 404
        with pytest.raises(ApiError) as exc:
            await post_input(mgr, "g/²", InputReq(append_ids=[1]))
        assert exc.value.status == 404
        assert not mgr.running and mgr.buffer.owner_of("g") is None
        mgr.check_integrity()

    asyncio.run(go())
