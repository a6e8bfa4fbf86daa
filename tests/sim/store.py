"""The buffer store's thread, replaced by work on the simulated loop (`SimDb`).

Everything the store does is its real code (`store.py`, `db_thread.py`: the same SQLite
statements, the same batching of queued commits into one transaction, savepoints, settling of
futures); only the thread is gone. Operations still run one at a time in submission order,
each after a seeded virtual latency, so a read or a commit takes "a while" and other callbacks
run meanwhile, as they do beside the real thread. `fail_next_write` makes the next commit fail
like a full disk would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import random
import sqlite3
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from april_server.buffer import store as store_module
from april_server.buffer.db_thread import MAX_BATCHED_COMMITS, DbOp, run_read, run_writes
from april_server.wire.errors import ApiError


class SimDb:
    rng: random.Random = random.Random(0)  # set per seed by `simulated_store`
    max_latency_s = 0.004

    def __init__(self, open_db: Callable[[], sqlite3.Connection]) -> None:
        self._db = open_db()
        self._ops: deque[DbOp] = deque()
        self._due: asyncio.TimerHandle | None = None
        self.fail_writes = 0  # commits still to fail (a full disk)

    def submit(self, fn: Callable[[sqlite3.Connection], Any], write: bool) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        self._ops.append(DbOp(fn, fut, write))
        self._schedule()
        return fut

    def run_now(self, fn: Callable[[sqlite3.Connection], Any], write: bool) -> Any:
        """A blocking call (start-up, integrity checks): what was queued first, then this."""
        while self._ops:
            self._step()
        fut = self.submit(fn, write)
        while self._ops:
            self._step()
        return fut.result()

    @property
    def busy(self) -> bool:
        return bool(self._ops)

    def stop(self) -> None:
        while self._ops:
            self._step()
        self._db.close()

    def _schedule(self) -> None:
        if self._due is not None or not self._ops:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the loop: `run_now` drains
        self._due = loop.call_later(self.rng.uniform(0, self.max_latency_s), self._tick)

    def _tick(self) -> None:
        self._due = None
        self._step()
        self._schedule()

    def _step(self) -> None:
        if not self._ops:
            return
        batch = [self._ops.popleft()]
        while (
            batch[0].write and self._ops and self._ops[0].write and len(batch) < MAX_BATCHED_COMMITS
        ):
            batch.append(self._ops.popleft())
        if batch[0].write and self.fail_writes:
            self.fail_writes -= 1
            for op in batch:
                if op.future.set_running_or_notify_cancel():
                    op.future.set_exception(OSError("simulated: disk full"))
            return
        if batch[0].write:
            run_writes(self._db, batch)
        else:
            run_read(self._db, batch[0])


@contextlib.contextmanager
def simulated_store(rng: random.Random) -> Iterator[None]:
    """`BufferStore` runs on `SimDb` (and its blocking calls drain it) while this holds."""
    saved_thread = store_module.DbThread
    saved_blocking = store_module.BufferStore._blocking

    def blocking(self: Any, fn: Any, write: bool = False) -> Any:
        return self._db.run_now(fn, write)

    SimDb.rng = rng
    store_module.DbThread = SimDb  # type: ignore[misc,assignment]
    store_module.BufferStore._blocking = blocking  # type: ignore[method-assign]
    try:
        yield
    finally:
        store_module.DbThread = saved_thread  # type: ignore[misc]
        store_module.BufferStore._blocking = saved_blocking  # type: ignore[method-assign]


@contextlib.contextmanager
def errors_recorded(record: Callable[[ApiError], None]) -> Iterator[None]:
    """Every `ApiError` made while this holds is passed to `record` as it is made (the raise
    is where the state that allowed it can be seen)."""
    saved = ApiError.__init__

    def init(self: ApiError, *args: Any, **kw: Any) -> None:
        saved(self, *args, **kw)
        record(self)

    ApiError.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        ApiError.__init__ = saved  # type: ignore[method-assign]
