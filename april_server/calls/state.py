"""What one `/rollouts` call holds while it runs (`rollout.py` drives it; `refill.py`
starts its groups, `wind_down.py` winds it down)."""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from typing import TYPE_CHECKING

from april_client.protocol import Group, RolloutReq, StreamEvent
from april_server.buffer.buffer_index import BufferEntry
from april_server.engine.segment_state import CallTally
from april_server.rules.quota import QuotaTracker

if TYPE_CHECKING:
    from april_server.runtime.manager import RolloutManager


class CallState:
    def __init__(
        self, mgr: RolloutManager, req: RolloutReq, handed_in: frozenset[str] = frozenset()
    ) -> None:
        self.mgr = mgr
        self.req = req
        self.handed_in = handed_in  # sent groups an earlier attempt of this request_id buffered
        self.batch_id = f"b-{uuid.uuid4().hex[:12]}"
        self.quota = QuotaTracker(req.target_groups)
        self.tally = CallTally()
        self.group_ids: list[str] = []  # every group this call holds, in the order claimed
        self.fresh: deque[str] = deque()  # sent groups not started yet
        self.ready: deque[str] = deque()  # claimed buffered groups not started yet
        self.events: asyncio.Queue[StreamEvent | None] | None = None
        self.started: set[str] = set()
        self.stopped = False
        self.wakeup = asyncio.Event()
        self.inflight_target: int | None = None
        self.peak_running = 0
        self.discarded: list[Group] = []
        self.tasks: dict[asyncio.Task[None], str] = {}  # segment tasks not yet collected
        self.active: dict[str, int] = {}  # group id -> its segment tasks not yet collected
        # Agent rollouts (turns_in_call.py): (sample id, turns ended, when) already announced as
        # awaiting input; groups an abort named, whose answers the call no longer waits for.
        self.announced: set[tuple[str, int, float]] = set()
        self.given_up: set[str] = set()
        self.closed = asyncio.Event()  # set once the call has handed its groups back

    async def _arrive(self, entries: list[BufferEntry]) -> list[Group]:
        """Groups just taken for this call (`PartialBuffer.take*`): counted as its own at once,
        before their bodies are read, and those whose body never came left out again."""
        self.group_ids.extend(e.group_id for e in entries)
        groups: list[Group] = []
        try:
            groups = await self.mgr.buffer.arrive(entries)
        finally:  # a failed read handed them all back (`arrive`); a missing body, that one
            got = {g.group_id for g in groups}
            lost = {e.group_id for e in entries} - got
            if lost:
                self.group_ids = [gid for gid in self.group_ids if gid not in lost]
        return groups
