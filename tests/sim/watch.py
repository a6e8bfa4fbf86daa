"""Watches over the server's own segment tasks (passive: no await, no draw, so the schedule
is the same watched or not).

A segment task records its end (tokens, then the snapshot's fate, often after awaiting the
engine's release of it) into the sample it ran, after it left `running`. Whoever held the
group must still hold it then, with that very body: a task that records into a group handed
back meanwhile writes to a body nobody holds any more (what it records is lost, and a snapshot
it keeps or frees is known to nobody), and one that records into a group another owner took
meanwhile writes behind that owner's back (which neither waited for it nor counts it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from april_server.engine.segment_runner import SegmentRunner
from april_server.root.manager import RolloutManager


@contextlib.contextmanager
def segment_ends_watched(
    manager: Callable[[], RolloutManager | None], failed: Callable[[str], None]
) -> Iterator[None]:
    """While this holds, `failed(what)` is called for every segment task that recorded its
    end into a group its owner no longer held (`manager()`: the running process's root)."""
    real = SegmentRunner._ended

    async def ended(self: SegmentRunner, run: Any, outcome: Any) -> None:
        await real(self, run, outcome)
        mgr = manager()
        if mgr is None or mgr.segments is not self:
            return  # a dead process's task
        s, buf = run.sample, mgr.buffer
        body = buf.claimed.get(s.group_id)
        holder = buf.owner_of(s.group_id)
        if body is None or body.samples[s.index] is not s or holder != run.owner:
            held = f"held by {holder}" if holder else "nobody holds"
            if holder and (body is None or body.samples[s.index] is not s):
                held += " since (handed back and taken again: another body)"
            failed(
                f"{s.sample_id}'s segment task (for {run.owner}) recorded its end into a group "
                f"{held}"
            )

    SegmentRunner._ended = ended  # type: ignore[method-assign]
    try:
        yield
    finally:
        SegmentRunner._ended = real  # type: ignore[method-assign]
