"""The buffer store's thread, replaced by work on the simulated loop (`SimDb`).

Everything the store does is its real code (`store.py`, `db_thread.py`: the same SQLite
statements, the same batching of queued commits into one transaction, savepoints, settling of
futures); only the thread is gone. Operations still run one at a time in submission order,
each after a seeded virtual latency, so a read or a commit takes "a while" and other callbacks
run meanwhile, as they do beside the real thread.

With faults (`StoreFaults`): a commit fails like a full disk (the whole transaction, every
commit batched in it), a commit's fsync is slow, a read fails like an I/O error; each at a
seeded rate. The harness's own reads are spared (`spare_next`), as are the blocking calls of
start-up and of integrity checks. `passive`: a blocking read (an integrity check) reads what is
committed now instead of first running what is queued, so observing does not change the
schedule it observes. The database outlives a crash (`Disk`): what was committed is what a
restart reads; what was queued and never ran is lost with the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import random
import sqlite3
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from april_server.buffer import store as store_module
from april_server.buffer.db_thread import MAX_BATCHED_COMMITS, DbOp, run_read, run_writes
from april_server.wire.errors import ApiError


@dataclass
class StoreFaults:
    """Seeded store faults (all off: the store never fails, as before faults existed)."""

    write_fail_p: float = 0.0  # a commit (its whole transaction) fails: a full disk
    slow_fsync_p: float = 0.0  # a commit's fsync takes 20-100x its usual time
    read_fail_p: float = 0.0  # a read fails: an I/O error
    passive: bool = False  # integrity checks read what is committed, running nothing queued


class Disk:
    """The database file of one seed: it outlives the process (`SimDb.crash`)."""

    def __init__(self) -> None:
        self.db: sqlite3.Connection | None = None
        # Groups a failed commit would have written or deleted: their stored bodies are older
        # than what memory held, so a KV snapshot taken since is known to nobody (a leak only
        # the snapshot sweep reclaims) and one freed since may still be referred to (a restore
        # of it finds nothing and re-prefills). The ledger allows both for these groups.
        self.failed_groups: set[str] = set()


class SimDb:
    rng: random.Random = random.Random(0)  # set per seed by `simulated_store`
    faults: StoreFaults = StoreFaults()
    disk: Disk | None = None  # set per seed by `simulated_store`
    max_latency_s = 0.004

    def __init__(self, open_db: Callable[[], sqlite3.Connection]) -> None:
        disk = SimDb.disk
        if disk is not None and disk.db is not None:
            self._db = disk.db  # a restart: the file as the crash left it
        else:
            self._db = open_db()
            if disk is not None:
                disk.db = self._db
        self._ops: deque[DbOp] = deque()
        self._due: asyncio.TimerHandle | None = None
        self.fail_writes = 0  # commits still to fail (a full disk)
        self.spare_next = False  # the next operation is the harness's: no fault
        self._doomed: set[int] = set()  # ids of reads chosen to fail
        self.dead = False
        SimDb.live.append(self)

    live: list[SimDb] = []  # the stores of the process that runs now (`crash`)

    def submit(self, fn: Callable[[sqlite3.Connection], Any], write: bool) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        if self.dead:
            raise RuntimeError("the process died")
        spared, self.spare_next = self.spare_next, False
        if not write and not spared and self.faults.read_fail_p:
            if self.rng.random() < self.faults.read_fail_p:
                self._doomed.add(id(fut))
        self._ops.append(DbOp(fn, fut, write))
        self._schedule()
        return fut

    def run_now(self, fn: Callable[[sqlite3.Connection], Any], write: bool) -> Any:
        """A blocking call (start-up, integrity checks): what was queued first, then this.
        Passive (`StoreFaults.passive`), a read runs alone on what is committed now."""
        if self.faults.passive and not write:
            return fn(self._db)
        while self._ops:
            self._step()
        fut = self.submit(fn, write)
        self._doomed.discard(id(fut))
        while self._ops:
            self._step()
        return fut.result()

    def crash(self) -> None:
        """The process dies: what is queued never runs; the file stays (`Disk`)."""
        self.dead = True
        self._ops.clear()
        self._due = None

    @property
    def busy(self) -> bool:
        return bool(self._ops)

    def stop(self) -> None:
        if self.dead:
            return  # its file belongs to the next process now
        while self._ops:
            self._step()
        if SimDb.disk is None or SimDb.disk.db is not self._db:
            self._db.close()

    def _schedule(self) -> None:
        if self._due is not None or not self._ops or self.dead:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the loop: `run_now` drains
        delay = self.rng.uniform(0, self.max_latency_s)
        if self.faults.slow_fsync_p and self._ops[0].write:
            if self.rng.random() < self.faults.slow_fsync_p:
                delay *= self.rng.uniform(20, 100)
        self._due = loop.call_later(delay, self._tick)

    def _tick(self) -> None:
        if self.dead:
            return
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
        write_fails = self.faults.write_fail_p and self.rng.random() < self.faults.write_fail_p
        if batch[0].write and (self.fail_writes or write_fails):
            self.fail_writes = max(0, self.fail_writes - 1)
            for op in batch:
                if op.future.set_running_or_notify_cancel():
                    op.future.set_exception(OSError("simulated: disk full"))
            return
        if batch[0].write:
            run_writes(self._db, batch)
        elif id(batch[0].future) in self._doomed:
            self._doomed.discard(id(batch[0].future))
            if batch[0].future.set_running_or_notify_cancel():
                batch[0].future.set_exception(OSError("simulated: read failed"))
        else:
            run_read(self._db, batch[0])


@contextlib.contextmanager
def simulated_store(rng: random.Random, faults: StoreFaults | None = None) -> Iterator[Disk]:
    """`BufferStore` runs on `SimDb` (and its blocking calls drain it) while this holds; the
    seed's database file is the `Disk` it yields."""
    saved_thread = store_module.DbThread
    saved_blocking = store_module.BufferStore._blocking
    saved_commit = store_module.BufferStore.commit

    def blocking(self: Any, fn: Any, write: bool = False) -> Any:
        return self._db.run_now(fn, write)

    async def commit(self: Any, put: Any, delete: Any, *args: Any, **kw: Any) -> Any:
        try:
            return await saved_commit(self, put, delete, *args, **kw)
        except OSError:
            disk.failed_groups.update([g.group_id for g, _ in put] + list(delete))
            raise

    disk = Disk()
    SimDb.rng = rng
    SimDb.faults = faults or StoreFaults()
    SimDb.disk = disk
    SimDb.live = []
    store_module.DbThread = SimDb  # type: ignore[misc,assignment]
    store_module.BufferStore._blocking = blocking  # type: ignore[method-assign]
    store_module.BufferStore.commit = commit  # type: ignore[method-assign]
    try:
        yield disk
    finally:
        store_module.DbThread = saved_thread  # type: ignore[misc]
        store_module.BufferStore._blocking = saved_blocking  # type: ignore[method-assign]
        store_module.BufferStore.commit = saved_commit  # type: ignore[method-assign]
        SimDb.faults = StoreFaults()
        SimDb.disk = None
        SimDb.live = []
        if disk.db is not None:
            disk.db.close()


def crash_stores() -> None:
    """Every store of the running process dies (`SimDb.crash`); the next ones open the file."""
    for db in SimDb.live:
        db.crash()
    SimDb.live = []


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


class _ExceptionsCounted:
    """A module's logger whose `exception()` also tells `record` (the rest as the logger)."""

    def __init__(self, real: Any, record: Callable[[], None]) -> None:
        self.real, self.record = real, record

    def exception(self, *args: Any, **kw: Any) -> None:
        self.record()
        self.real.exception(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@contextlib.contextmanager
def failures_logged(module: Any, record: Callable[[], None]) -> Iterator[None]:
    """`record()` is called whenever `module` logs an exception (the background's round that
    failed: the simulator's logging is off, so its log says nothing)."""
    real = module.logger
    module.logger = _ExceptionsCounted(real, record)
    try:
        yield
    finally:
        module.logger = real
