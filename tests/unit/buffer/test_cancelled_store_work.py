"""The store's thread (`db_thread.py`) outlives callers that leave: a read whose caller was
cancelled does not kill it, a write whose caller was cancelled still lands. Real SQLite."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from april_server.buffer.store import BufferStore


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
