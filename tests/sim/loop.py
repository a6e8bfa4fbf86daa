"""A deterministic event loop: virtual time, and a seeded choice of the next ready callback.

One seed is one interleaving, replayed exactly:
- `time()` is virtual: when nothing is ready, the clock jumps to the next timer, so a
  simulated minute of engine steps costs what its callbacks cost, not a minute.
- Of the callbacks ready now, the loop runs one chosen by the seeded generator, then chooses
  again among what is ready then (what it ran may have readied more). Every order asyncio
  could produce for callbacks ready together is reachable, and many it rarely produces.
- Tasks hash by creation order, not by address, so iterating a set of tasks (`asyncio.wait`'s
  `done`) visits them in the same order on every run of a seed.
- Nothing here runs on another thread: `call_soon_threadsafe` is `call_soon`, and work handed
  to an executor (`asyncio.to_thread`: a text answer's tokenizer) runs on the loop, its future
  settled at once.
- A crash (`Crash`, raised between two callbacks) stops the loop where it stands, like a
  `kill -9`: no callback runs again, no task is cancelled (a cancellation would run the
  server's clean-up code, which a killed process never runs). `run` then closes the dead
  tasks' coroutines quietly and returns the crash; a new loop carries on from its clock.
`determinism()` also points `time.time`/`perf_counter`/`monotonic`, `uuid.uuid4` and
`secrets.randbelow` at the loop's clock and generator while a seed runs, since the server reads
them and would otherwise make two runs of a seed differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import random
import secrets
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

START_TIME = 1_000_000.0  # virtual seconds at a seed's start (not 0: code subtracts ages)


class Wedged(RuntimeError):
    """Nothing is ready and no timer is due, yet the main coroutine has not ended."""


class Crash(BaseException):
    """The simulated process dies here (raised between two callbacks; `run` returns it)."""

    def __init__(self, at: float) -> None:
        super().__init__(f"crash at t={at - START_TIME:.4f} s")
        self.at = at


class SimTask(asyncio.Task):  # type: ignore[type-arg]
    """A task that hashes by creation order (sets of tasks iterate alike on every run)."""

    _sim_id = 0

    def __init__(self, coro: Coroutine[Any, Any, Any], *, loop: Any, **kw: Any) -> None:
        super().__init__(coro, loop=loop, **kw)
        loop._task_count += 1
        self._sim_id = loop._task_count

    def __hash__(self) -> int:
        return self._sim_id


class SimLoop(asyncio.SelectorEventLoop):
    def __init__(self, seed: int, max_virtual_s: float = 3600.0, start: float = START_TIME) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.now = start
        self.max_virtual_s = max_virtual_s
        self.steps = 0  # callbacks run
        self._task_count = 0
        self.after_step: Callable[[], None] | None = None  # e.g. a random integrity check
        self.set_task_factory(lambda loop, coro, **kw: SimTask(coro, loop=loop, **kw))

    def time(self) -> float:
        return self.now

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:
        return self.call_soon(callback, *args, context=context)

    def _write_to_self(self) -> None:
        pass

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self.create_future()
        try:
            fut.set_result(func(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            fut.set_exception(exc)
        return fut

    def _run_once(self) -> None:
        ready, scheduled = self._ready, self._scheduled
        while scheduled and scheduled[0]._cancelled:
            heapq.heappop(scheduled)._scheduled = False
        if not ready and not self._stopping:
            if not scheduled:
                raise Wedged(
                    f"nothing ready and no timer at t={self.now - START_TIME:.3f} s\n"
                    + describe_tasks(self)
                )
            self.now = max(self.now, scheduled[0]._when)
            if self.now - START_TIME > self.max_virtual_s:
                raise Wedged(f"still running after {self.max_virtual_s:.0f} virtual seconds")
        while scheduled and scheduled[0]._when <= self.now:
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            if not handle._cancelled:
                ready.append(handle)
        if not ready:
            return
        i = self.rng.randrange(len(ready))
        ready.rotate(-i)
        handle = ready.popleft()
        ready.rotate(i)
        if handle._cancelled:
            return
        self.steps += 1
        handle._run()
        if self.after_step is not None:
            self.after_step()


class _Clock:
    def __init__(self, loop: SimLoop) -> None:
        self.loop = loop

    def __call__(self) -> float:
        return self.loop.now


@contextlib.contextmanager
def determinism(loop: SimLoop) -> Iterator[None]:
    """Route the server's reads of time and randomness to `loop` while a seed runs."""
    clock = _Clock(loop)
    ids = random.Random(loop.rng.random())
    saved = (time.time, time.perf_counter, time.monotonic, uuid.uuid4, secrets.randbelow)
    time.time = time.perf_counter = time.monotonic = clock  # type: ignore[assignment]
    uuid.uuid4 = lambda: uuid.UUID(int=ids.getrandbits(128), version=4)  # type: ignore[assignment]
    secrets.randbelow = lambda n: ids.randrange(n)  # type: ignore[assignment]
    try:
        yield
    finally:
        time.time, time.perf_counter, time.monotonic, uuid.uuid4, secrets.randbelow = saved


def run(
    seed: int,
    main: Callable[[], Coroutine[Any, Any, Any]],
    max_virtual_s: float,
    start: float = START_TIME,
) -> Crash | None:
    """Run `main()` to its end on a fresh `SimLoop` for `seed`, its clock at `start`; returns
    the `Crash` that stopped it instead, if one did."""
    loop = SimLoop(seed, max_virtual_s, start)
    asyncio.set_event_loop(loop)
    crash: Crash | None = None
    try:
        with determinism(loop):
            loop.run_until_complete(main())
    except Crash as exc:
        crash = exc
    finally:
        if crash is not None:
            _bury(loop)
        else:
            with contextlib.suppress(Exception):
                _cancel_all(loop)
        asyncio.set_event_loop(None)
        loop.close()
    return crash


def _bury(loop: SimLoop) -> None:
    """A crashed loop's tasks never run again: close their coroutines now, oldest first, so
    that the clean-up code they hold (`finally` blocks, against the dead process's objects
    only) runs at this known point, not whenever the garbage collector finds them during a
    later seed. Whatever that code raises is the dead process's."""
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: getattr(t, "_sim_id", 0))
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _: None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t in tasks:
                coro: Any = t.get_coro()
                with contextlib.suppress(BaseException):
                    coro.close()
                t._log_destroy_pending = False  # type: ignore[attr-defined]
            loop._ready.clear()  # type: ignore[attr-defined]
            loop._scheduled.clear()  # type: ignore[attr-defined]
            gc.collect()
    finally:
        sys.unraisablehook = hook


def _cancel_all(loop: SimLoop) -> None:
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def describe_tasks(loop: asyncio.AbstractEventLoop) -> str:
    """Where every pending task waits (printed with a wedge)."""
    import io

    out = io.StringIO()
    for t in asyncio.all_tasks(loop):
        if t.done():
            continue
        coro: Any = t.get_coro()
        chain = []
        while coro is not None and hasattr(coro, "cr_frame"):
            frame = coro.cr_frame
            if frame is not None:
                chain.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
            coro = coro.cr_await
        print(f"{t.get_name()} waits: " + " <- ".join(chain), file=out)
    return out.getvalue()
