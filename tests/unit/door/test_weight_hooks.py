"""The weight-update hooks (door/weight_hooks.py) over a fake TokenizerManager and the
process's weight session: a push with `abort_all_requests` whose flush raced the abort answers
success once the flush went through, and the version the tokenizer reports equals the one the
scheduler stamps; pushes and begin..end sessions cut our segments and let them continue."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from april_server.door import weight_hooks
from april_server.door.weight_hooks import WeightHooks
from april_server.engine.weight_session import UpdateListener, WeightSession


@dataclass
class Obj:
    weight_version: str | None = "v2"
    abort_all_requests: bool = True


@dataclass
class Out:
    success: bool


class Lock:
    @property
    def writer_lock(self) -> Any:
        @asynccontextmanager
        async def held() -> Any:
            yield

        return held()


@dataclass
class FakeTm:
    busy_flushes: int  # flushes refused before the aborted requests left
    version: str = "v1"
    aborts: int = 0
    model_update_lock: Lock = field(default_factory=Lock)

    async def flush_cache(self) -> Out:
        self.busy_flushes -= 1
        return Out(self.busy_flushes < 0)

    def abort_request(self, abort_all: bool = False) -> None:
        self.aborts += 1

    def _update_weight_version_if_provided(self, v: str | None) -> None:
        if v is not None:
            self.version = v


def hooks(cut: UpdateListener | None = None, limit_s: float = 300.0) -> WeightHooks:
    """The hooks over a session of their own, cutting `cut` (the root's weight cut)."""
    session = WeightSession(limit_s=limit_s)
    if cut is not None:
        session.cut_by(cut)
    return WeightHooks(session)


async def raced(tm: FakeTm, obj: Obj) -> tuple[bool, str, int]:
    return False, weight_hooks.UPDATED_BUT_NOT_FLUSHED + " because requests are still running", 0


def test_a_raced_flush_is_retried_and_the_push_succeeds() -> None:
    tm = FakeTm(busy_flushes=3)
    ok, msg, _ = asyncio.run(hooks().around_update(raced, tm, Obj()))
    assert ok, msg
    assert tm.version == "v2" and tm.aborts == 3


def test_a_flush_that_never_goes_through_still_reports_the_version() -> None:
    tm = FakeTm(busy_flushes=10**9)

    async def go() -> tuple[bool, str, int]:
        weight_hooks.FLUSH_DEADLINE_S, old = 0.2, weight_hooks.FLUSH_DEADLINE_S
        try:
            return await hooks().around_update(raced, tm, Obj())
        finally:
            weight_hooks.FLUSH_DEADLINE_S = old

    ok, msg, _ = asyncio.run(go())
    assert not ok and msg.startswith(weight_hooks.UPDATED_BUT_NOT_FLUSHED)
    assert tm.version == "v2"  # the weights did change: the version says so


def test_without_abort_the_flush_is_retried_without_aborting_anything() -> None:
    tm = FakeTm(busy_flushes=2)
    ok, _, _ = asyncio.run(hooks().around_update(raced, tm, Obj(abort_all_requests=False)))
    assert ok and tm.aborts == 0 and tm.version == "v2"


def test_a_distributed_update_whose_flush_raced_its_cut_segments_succeeds_too() -> None:
    """`update_weights_from_distributed` answers (success, message), not disk's triple: seen in
    `make bench-weights`, a broadcast during background generation answered 400 because the
    segments cut for it were still leaving the batch."""

    async def raced_two(tm: FakeTm, obj: Obj) -> tuple[bool, str]:
        return False, weight_hooks.UPDATED_BUT_NOT_FLUSHED + " because requests are still running"

    tm = FakeTm(busy_flushes=2)
    out = asyncio.run(hooks().around_update(raced_two, tm, Obj(abort_all_requests=False)))
    assert len(out) == 2 and out[0] and tm.version == "v2" and tm.aborts == 0


class Segments:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def before_update(self) -> None:
        self.log.append("cut")

    def after_update(self) -> None:
        self.log.append("continue")


def test_our_segments_are_cut_before_the_update_and_continue_after_the_flush() -> None:
    log: list[str] = []
    h = hooks(Segments(log))
    tm = FakeTm(busy_flushes=1)

    async def update(tm: FakeTm, obj: Obj) -> tuple[bool, str, int]:
        log.append("update")
        return await raced(tm, obj)

    real_flush = tm.flush_cache

    async def flush() -> Out:
        log.append("flush")
        return await real_flush()

    tm.flush_cache = flush  # type: ignore[method-assign]
    ok, _, _ = asyncio.run(h.around_update(update, tm, Obj(abort_all_requests=False)))
    assert ok and log == ["cut", "update", "flush", "flush", "continue"]
    log.clear()  # a caller that aborts everything gets no cut: its abort ends them
    asyncio.run(h.around_update(update, tm, Obj(abort_all_requests=True)))
    assert "cut" not in log and "continue" not in log


def test_other_answers_pass_through() -> None:
    async def fine(tm: FakeTm, obj: Obj) -> tuple[bool, str, int]:
        return True, "Succeeded", 0

    tm = FakeTm(busy_flushes=0)
    assert asyncio.run(hooks().around_update(fine, tm, Obj()))[0]
    assert tm.version == "v1"  # SGLang itself records it on success


@dataclass
class Listener:
    events: list[str] = field(default_factory=list)

    async def before_update(self) -> None:
        self.events.append("cut")

    def after_update(self) -> None:
        self.events.append("continue")


def _with_listener(limit_s: float = 300.0) -> tuple[WeightHooks, Listener]:
    lst = Listener()
    return hooks(lst, limit_s), lst


async def _ok(tm: Any, obj: Any) -> tuple[bool, str]:
    return True, "Success"


async def _refused(tm: Any, obj: Any) -> tuple[bool, str]:
    return False, "a weight-update session is already open"


def test_a_session_holds_the_segments_cut_from_begin_to_end() -> None:
    """#34: between a session's messages the model is mid-update (buckets), so our segments
    stay cut for the whole session; the updates inside it cut nothing more."""
    h, lst = _with_listener()
    tm, obj = FakeTm(busy_flushes=0), Obj(abort_all_requests=False)

    async def go() -> None:
        assert await h.around_begin(_ok, tm, obj) == (True, "Success")
        assert lst.events == ["cut"] and h.session.open
        for _ in range(3):  # three buckets
            assert await h.around_update(_ok, tm, obj) == (True, "Success")
        assert lst.events == ["cut"]  # still held
        await h.around_end(_ok, tm, obj)
        assert lst.events == ["cut", "continue"] and not h.session.open
        assert h.session._watchdog is None
        await h.around_update(_ok, tm, obj)  # outside a session: its own cut
        assert lst.events == ["cut", "continue", "cut", "continue"]

    asyncio.run(go())


def test_a_refused_begin_holds_nothing_and_a_forgotten_session_expires() -> None:
    h, lst = _with_listener(limit_s=0.01)
    tm, obj = FakeTm(busy_flushes=0), Obj(abort_all_requests=False)

    async def go() -> None:
        await h.around_begin(_refused, tm, obj)
        assert lst.events == ["cut", "continue"] and not h.session.open
        await h.around_begin(_ok, tm, obj)  # never ended
        assert h.session.open
        await asyncio.sleep(0.1)
        assert lst.events == ["cut", "continue", "cut", "continue"] and not h.session.open

    asyncio.run(go())


def test_a_flush_behind_requests_paused_in_place_gives_up_instead_of_wedging() -> None:
    """Found by review: requests paused in place (`/pause_generation` mode in_place) hold
    their reader locks until the trainer continues them, which it does after the push
    answers; the flush waited for the writer lock without a bound, so the push never
    answered, and every new request queued behind it. Now it gives up at the deadline and
    the push answers SGLang's own "updated but not flushed"."""

    class HeldByPausedRequests:
        @property
        def writer_lock(self) -> Any:
            @asynccontextmanager
            async def never() -> Any:
                await asyncio.Event().wait()
                yield

            return never()

    tm = FakeTm(busy_flushes=0, model_update_lock=HeldByPausedRequests())  # type: ignore[arg-type]

    async def go() -> tuple[bool, str, int]:
        weight_hooks.FLUSH_DEADLINE_S, old = 0.2, weight_hooks.FLUSH_DEADLINE_S
        try:
            return await asyncio.wait_for(hooks().around_update(raced, tm, Obj()), 5)
        finally:
            weight_hooks.FLUSH_DEADLINE_S = old

    ok, msg, _ = asyncio.run(go())  # before the fix: TimeoutError (waited for good)
    assert not ok and msg.startswith(weight_hooks.UPDATED_BUT_NOT_FLUSHED)
    assert tm.version == "v2"


def test_a_second_begin_or_a_racing_push_does_not_release_a_session() -> None:
    """Found by review: a second begin sent while the first still waited for SGLang's answer
    cut again, and its refusal ("already open") continued the segments inside the first's
    session; a plain push that began before the session and ended inside it did the same.
    Either let our segments generate on half-updated weights."""
    h, lst = _with_listener()
    tm, obj = FakeTm(busy_flushes=0), Obj(abort_all_requests=False)
    gate = asyncio.Event

    async def go() -> None:
        answer = gate()

        async def slow_ok(tm: Any, obj: Any) -> tuple[bool, str]:
            await answer.wait()
            return True, "Success"

        first = asyncio.ensure_future(h.around_begin(slow_ok, tm, obj))
        await asyncio.sleep(0.01)
        assert await h.around_begin(_refused, tm, obj) == (False, _refused_msg)
        answer.set()
        assert (await first)[0] and h.session.open
        assert lst.events == ["cut"]  # held: the refused second begin released nothing
        pushed = gate()

        async def slow_push(tm: Any, obj: Any) -> tuple[bool, str]:
            await pushed.wait()
            return True, "Success"

        await h.around_end(_ok, tm, obj)
        assert lst.events == ["cut", "continue"]
        push = asyncio.ensure_future(h.around_update(slow_push, tm, obj))
        await asyncio.sleep(0.01)  # the push cut its segments ...
        assert await h.around_begin(_ok, tm, obj) == (
            True,
            "Success",
        )  # ... a session began
        pushed.set()
        await push
        # Still held (cut by the push, and by the begin), by the session now.
        assert lst.events == ["cut", "continue", "cut", "cut"]
        await h.around_end(_ok, tm, obj)
        assert lst.events[4:] == ["continue", "continue"] and not h.session.open

    asyncio.run(go())


_refused_msg = "a weight-update session is already open"
