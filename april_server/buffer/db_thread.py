"""The buffer store's database thread: SQLite work off the event loop, one operation at a time.

One thread owns the connection and runs every operation in the order it was submitted, so
commits land in call order and a read sees every commit submitted before it; callers await a
future. Commits queued behind one another share one transaction and one fsync, each in its
own savepoint, so one that fails does not take the others with it. What the operations do
(the schema, the statements) is `store.py`'s; the simulator runs the same `run_writes` and
`run_read` on its loop instead of this thread (tests/sim/store.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import sqlite3
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

MAX_BATCHED_COMMITS = 64  # commits that may share one transaction (one fsync)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DbOp:
    fn: Callable[[sqlite3.Connection], Any]
    future: cf.Future[Any]
    write: bool


class DbThread:
    """The connection's own thread: operations run one at a time, in submission order.
    `open_db` opens the connection, on the thread (whatever it raises, the constructor does)."""

    def __init__(self, open_db: Callable[[], sqlite3.Connection]) -> None:
        self._ops: deque[DbOp] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        opened: cf.Future[None] = cf.Future()
        self._thread = threading.Thread(
            target=self._run, args=(open_db, opened), name="april-store", daemon=True
        )
        self._thread.start()
        opened.result()  # raises what opening raised (bad path, corrupt file)

    def submit(self, fn: Callable[[sqlite3.Connection], T], write: bool) -> cf.Future[T]:
        fut: cf.Future[T] = cf.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the buffer store is closed")
            self._ops.append(DbOp(fn, fut, write))
            self._cv.notify()
        return fut

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self, open_db: Callable[[], sqlite3.Connection], opened: cf.Future[None]) -> None:
        try:
            db = open_db()
        except BaseException as exc:
            opened.set_exception(exc)
            return
        opened.set_result(None)
        try:
            while True:
                with self._cv:
                    while not self._ops and not self._stopping:
                        self._cv.wait()
                    if not self._ops:
                        return
                    batch = [self._ops.popleft()]
                    while (
                        batch[0].write
                        and self._ops
                        and self._ops[0].write
                        and len(batch) < MAX_BATCHED_COMMITS
                    ):
                        batch.append(self._ops.popleft())
                try:
                    if batch[0].write:
                        run_writes(db, batch)
                    else:
                        run_read(db, batch[0])
                except BaseException as exc:
                    # One operation must never take the thread down: every later one would hang.
                    logger.exception("april: buffer store operation failed")
                    for op in batch:
                        settle(op.future, False, exc)
        finally:
            db.close()


def settle(future: cf.Future[Any], ok: bool, value: Any) -> None:
    """Hand a result to whoever still waits. A caller that went away (a streamed call whose
    client disconnected) has cancelled its future: setting it would raise and kill the thread."""
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def run_writes(db: sqlite3.Connection, batch: list[DbOp]) -> None:
    """Queued commits in one transaction (one fsync), each in its own savepoint."""
    # A write runs even if its caller was cancelled meanwhile: the caller's memory already
    # counts on it (persist is awaited to its end, `run_to_end`), so skipping it could lose data.
    for op in batch:
        op.future.set_running_or_notify_cancel()  # from now on a cancel is refused
    results: list[tuple[bool, Any]] = []
    try:
        db.execute("BEGIN IMMEDIATE")
        for i, op in enumerate(batch):
            db.execute(f"SAVEPOINT op{i}")
            try:
                results.append((True, op.fn(db)))
                db.execute(f"RELEASE op{i}")
            except Exception as exc:
                db.execute(f"ROLLBACK TO op{i}")
                db.execute(f"RELEASE op{i}")
                results.append((False, exc))
        db.execute("COMMIT")  # fsync: only now is anything acknowledged
    except BaseException as exc:
        if db.in_transaction:
            db.execute("ROLLBACK")
        for op in batch:
            settle(op.future, False, exc)
        return
    for op, (ok, value) in zip(batch, results, strict=True):
        settle(op.future, ok, value)


def run_read(db: sqlite3.Connection, op: DbOp) -> None:
    if not op.future.set_running_or_notify_cancel():
        return  # nobody waits for this read any more
    try:
        value = op.fn(db)
    except BaseException as exc:
        settle(op.future, False, exc)
        return
    settle(op.future, True, value)
