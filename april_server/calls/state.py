"""What one `/rollouts` call holds while it runs: plain data, changed by the call's steps
(`refill.py`, `turns_in_call.py`, `wind_down.py`) and read by `rollout.py`'s loop."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from april_client.protocol import Group, RolloutReq, StreamEvent
from april_server.engine.segment_state import CallTally
from april_server.rules.goodput import GoodputChoice
from april_server.rules.quota import QuotaTracker


class CallState:
    def __init__(
        self,
        req: RolloutReq,
        handed_in: frozenset[str] = frozenset(),
        events: asyncio.Queue[StreamEvent | None] | None = None,
    ) -> None:
        """`events`: the caller's stream (a streamed call); None for a plain one."""
        self.req = req
        self.handed_in = handed_in  # sent groups an earlier attempt of this request_id buffered
        self.batch_id = f"b-{uuid.uuid4().hex[:12]}"
        self.quota = QuotaTracker(req.target_groups)
        self.tally = CallTally()
        self.group_ids: list[str] = []  # every group this call holds, in the order claimed
        self.fresh: deque[str] = deque()  # sent groups not started yet
        self.ready: deque[str] = deque()  # claimed buffered groups not started yet
        self.events = events
        self.started: set[str] = set()
        self.stopped = False
        self.wakeup = asyncio.Event()
        self.inflight_target: int | None = None
        # "auto": groups in progress allowed beyond what the quota still needs, and the
        # goodput play that chose it (`rules/goodput.py`); before there is one, 0 under a
        # max_staleness, else None (no bound beyond the running target).
        self.extra_groups: int | None = None
        self.goodput: GoodputChoice | None = None
        self.peak_running = 0
        self.discarded: list[Group] = []
        self.tasks: dict[asyncio.Task[None], str] = {}  # segment tasks not yet collected
        self.active: dict[str, int] = {}  # group id -> its segment tasks not yet collected
        # Agent rollouts (turns_in_call.py): (sample id, turns ended, when) already announced as
        # awaiting input; groups an abort named, whose answers the call no longer waits for.
        self.announced: set[tuple[str, int, float]] = set()
        self.given_up: set[str] = set()
        self.closed = asyncio.Event()  # set once the call has handed its groups back

    def note_running(self) -> None:
        self.peak_running = max(self.peak_running, len(self.tasks))

    def emit(self, event: StreamEvent) -> None:
        """To the caller's stream, if it has one."""
        if self.events is not None:
            self.events.put_nowait(event)


@dataclass
class QuotaGrace:
    """Once the quota is met, a streamed call waits `reject_grace_s` for late rejects (DAPO
    filtering) while generation goes on; a reject re-opens the quota, and the wait with it."""

    t0: float
    grace_s: float
    time_to_quota: float | None = field(default=None, init=False)  # for the answer's stats
    until: float | None = field(default=None, init=False)

    def left(self) -> float:
        """Seconds of grace left (the quota is met now)."""
        now = time.perf_counter()
        if self.time_to_quota is None:
            self.time_to_quota = now - self.t0
        if self.until is None:
            self.until = now + self.grace_s
        return self.until - now

    def reopen(self) -> None:
        self.until = None
        self.time_to_quota = None
