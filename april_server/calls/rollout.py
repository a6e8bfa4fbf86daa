"""One APRIL step: `POST /april/v1/rollouts`, steps 2-10 of the request lifecycle
(docs/architecture.md numbers them): validate, size the running set, start groups whole as they
fit, count them as they finish, then stop the rest, answer exactly `target_groups` groups,
persist before answering, and hand `continue` stragglers to the background.

Where each step lives: 2 in `new_groups.py` and `RolloutCall.prepare`; the run loop (`run`)
here; 3, 4 and 6 in `refill.py`; 7-10 in `wind_down.py`, where a call ends and the background
begins; turns within a call in `turns_in_call.py`. Each is a part that acts on the call's
`CallState` (`state.py`) with the parts it is handed (`parts.py`). The quota:
`rules/quota.py`; `request_id` retries: `rules/idempotency.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

import msgspec

from april_client.protocol import RejectReq, RolloutReq, RolloutResp, StreamEvent
from april_server.buffer.store import BufferStore
from april_server.calls.new_groups import new_groups
from april_server.calls.parts import CallParts
from april_server.calls.refill import Refill
from april_server.calls.state import CallState, QuotaGrace
from april_server.calls.turns_in_call import TurnsInCall
from april_server.calls.wind_down import WindDown
from april_server.engine.segment_state import BACKGROUND, Counters
from april_server.rules.idempotency import handed_in_by, is_attempt
from april_server.runtime.background import Background
from april_server.runtime.live_calls import LiveCalls
from april_server.runtime.run_to_end import run_to_end
from april_server.wire.errors import bad_request, conflict
from april_server.wire.ids import check_id

logger = logging.getLogger(__name__)
MAX_REJECT_GRACE_S = 60.0
_enc = msgspec.json.Encoder()
_resp_dec = msgspec.json.Decoder(RolloutResp)


class RolloutCall:
    """One call: its state and the parts that act on it. What the rest of the server may ask
    of it (`runtime.live_calls.LiveCall`) is its `state`, its `turns` and `reject`."""

    def __init__(
        self,
        req: RolloutReq,
        parts: CallParts,
        handed_in: frozenset[str] = frozenset(),
        events: asyncio.Queue[StreamEvent | None] | None = None,
    ) -> None:
        self.state = state = CallState(req, handed_in, events)
        self.parts = parts  # step 2 and the run loop use the engine, buffer, lengths, calls
        buffer, generation = parts.holdings.buffer, parts.generation
        self.turns = TurnsInCall(state, parts.engine, buffer, generation.segments)
        self.refill = Refill(
            state, self.turns, buffer, generation.segments, parts.background, parts.sizing
        )
        self.wind_down = WindDown(
            state, self.turns, parts.holdings, generation, parts.background, parts.sizing
        )

    def reject(self, body: RejectReq) -> None:
        """`POST /rollouts/{batch_id}/reject`: un-count finished groups (DAPO filtering)."""
        if self.state.stopped:
            raise conflict("batch_done", f"batch {self.state.batch_id!r} already reached its quota")
        self.state.quota.reject(body.group_ids)
        self.state.wakeup.set()

    # ---- the lifecycle ----------------------------------------------------------------------

    async def prepare(self) -> None:
        """Step 2: validation. Raises ApiError before anything starts."""
        state, parts = self.state, self.parts
        buffer, req = parts.holdings.buffer, state.req
        if req.target_groups < 1:
            raise bad_request("invalid_target", "target_groups must be >= 1")
        if isinstance(req.max_inflight_groups, int) and req.max_inflight_groups < 1:
            raise bad_request("invalid_request", "max_inflight_groups must be >= 1 or 'auto'")
        if req.max_staleness is not None and req.max_staleness < 0:
            raise bad_request("invalid_request", "max_staleness must be >= 0 or null")
        if not 0.0 <= req.reject_grace_s <= MAX_REJECT_GRACE_S:
            raise bad_request(
                "invalid_request", f"reject_grace_s must lie in [0, {MAX_REJECT_GRACE_S}]"
            )
        fresh = await new_groups(
            parts.engine,
            buffer,
            req.groups,
            state.handed_in,
            req.turns,
            req.return_routed_experts,
            req.return_sampling_mask,
        )
        await self._settle_own_groups()
        # From here to the claims below nothing awaits: what is decided is what is taken.
        for g in fresh:  # the validation yielded: another call may have sent the same id
            if buffer.known(g.group_id):
                raise conflict("group_exists", f"group {g.group_id!r} is already known")
        # A retry takes back what its earlier attempt left in the buffer; those another call
        # holds or already delivered are not this call's to run again.
        again = [
            s.group_id
            for s in req.groups
            if s.group_id in state.handed_in
            and s.group_id in buffer.idle
            and buffer.owner_of(s.group_id) is None
        ]
        # Groups waiting only for answers are not available: nothing of them can run.
        buffered = buffer.idle.claimable if req.resume_first else len(again)
        available = buffered + len(fresh)
        if req.target_groups > available:
            raise bad_request(
                "invalid_target",
                f"target_groups {req.target_groups} exceeds the {available} groups available "
                f"({len(fresh)} sent, {buffered} buffered and idle)",
            )
        parts.calls.add(self)
        # Sent groups are this call's from now on; buffered ones are claimed as it needs them
        # (`Refill._next_group`), so the rest stay available to other calls.
        buffer.adopt(fresh, state.batch_id)
        state.group_ids.extend(g.group_id for g in fresh)
        entries = buffer.take(again, state.batch_id, busy_code="group_busy")
        # New groups start in the call's length order (predicted longest first: the tail
        # begins early and short ones fill the batch; docs/api.md, Length prediction).
        lengths = parts.lengths
        order = lengths.order(fresh, req.length_order or lengths.default_order)
        state.fresh = deque(g.group_id for g in order)
        if again:  # claimed whole now, started before anything else
            taken = await self.refill.arrive(entries)
            state.ready.extend(g.group_id for g in taken)
            await parts.background.restart_stale(taken, state.tally)

    async def _settle_own_groups(self) -> None:
        """Before a retry decides which of its own groups it runs again: wait out an
        operation that holds one now (an answer being made durable, a resume, a delete), and
        have the background give back those it runs; groups another call holds are left to
        it. Their holders are read from the map again after every wait."""
        state, buf, calls = self.state, self.parts.holdings.buffer, self.parts.calls
        own = [s.group_id for s in state.req.groups if s.group_id in state.handed_in]
        gave_way = False
        while own:
            holders = [h for gid in own if (h := buf.holder(gid)) is not None]
            busy = [h for h in holders if h.owner not in calls and h.owner != BACKGROUND]
            if busy:
                await busy[0].released.wait()
            elif not gave_way and any(h.owner == BACKGROUND for h in holders):
                await self.parts.background.give_way()  # buffered again first
                gave_way = True
            else:
                return

    async def run(self) -> RolloutResp:
        """Steps 3-10 of the request lifecycle; `prepare()` (step 2) must have
        succeeded."""
        state, refill = self.state, self.refill
        t0 = time.perf_counter()
        grace = QuotaGrace(t0, state.req.reject_grace_s if state.req.stream else 0.0)
        cancelled = False
        failure: Exception | None = None
        try:
            # Inside the try: the caller may already hold a started stream (its groups are
            # acknowledged), so a cancellation even here must wind down and keep them.
            limit, sample_target = await refill.inflight_limits()  # 3: the running target
            await refill.take_over_background(limit, sample_target)
            await self.parts.generation.planner.admission_ready()  # 3: the admission bound
            while True:
                if state.quota.met:  # 6: met; a streamed call may still take late rejects
                    left = grace.left()
                    if left <= 0:
                        break
                    await self._wait_for_segments(left)
                    continue
                grace.reopen()  # a reject re-opened the quota
                await refill.refill(limit, sample_target)  # 4-5: start groups whole
                if state.quota.met:
                    continue
                if not state.tasks and not self.turns.waits_for_input():
                    break  # nothing generating and nothing left: the quota is out of reach
                await self._wait_for_segments()  # 6: count groups as they finish
        except asyncio.CancelledError:
            cancelled = True  # the caller went away: keep everything, acknowledge nothing
        except Exception as exc:  # a bug: the caller gets a 500, its groups stay buffered
            logger.exception(
                "april: rollout %s failed; its groups go back to the buffer", state.batch_id
            )
            failure = exc
        # Steps 7-10 run to the end even if we are cancelled again meanwhile (a client that
        # disconnects can cancel more than once): half a wind-down would leave requests
        # generating or a buffer that differs from the disk.
        delivered = not cancelled and failure is None
        resp = await run_to_end(self.wind_down.wind_down(t0, grace.time_to_quota, delivered))
        if failure is not None:
            raise failure
        if cancelled:
            raise asyncio.CancelledError
        return resp

    async def _wait_for_segments(self, timeout: float | None = None) -> None:
        """Until a segment ends, an answer starts one (`turns_in_call.py`), or `timeout`;
        then account for the segments that ended."""
        state = self.state
        state.wakeup.clear()
        waiter = asyncio.ensure_future(state.wakeup.wait())
        done, _ = await asyncio.wait(
            [*state.tasks, waiter], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        waiter.cancel()
        self.refill.collect(cast(set[asyncio.Task[None]], done - {waiter}))

    def close(self) -> None:
        batch_id = self.state.batch_id
        self.parts.calls.end(batch_id)
        self.parts.holdings.buffer.release(batch_id)
        self.state.closed.set()


@dataclass(eq=False)
class Rollout:
    """`POST /april/v1/rollouts`, honouring `request_id` idempotency: a retry gets the
    response of the attempt that delivered one; if none did (its caller went away, or it
    failed), the retry runs again, on the groups the earlier attempt handed in."""

    store: BufferStore  # a `request_id`'s earlier answer
    calls: LiveCalls
    background: Background  # gives way to every call
    counters: Counters
    call_parts: CallParts  # handed to each call whole: its steps take what they use

    async def __call__(
        self,
        req: RolloutReq,
        events: asyncio.Queue[StreamEvent | None] | None = None,
        ready: asyncio.Future[None] | None = None,
    ) -> RolloutResp:
        calls = self.calls
        self.counters.rollout_calls += 1
        rid = req.request_id
        handed_in: frozenset[str] = frozenset()
        if rid is not None:
            check_id("request_id", rid)
            while True:
                stored = await self.store.load_call(rid)
                if stored is not None and not is_attempt(stored):
                    _set(ready)
                    return _resp_dec.decode(stored)
                pending = calls.attempts.get(rid)
                if pending is None:
                    handed_in = frozenset() if stored is None else handed_in_by(stored)
                    break
                earlier = await asyncio.shield(pending)  # another attempt of this id is running
                if earlier is not None:
                    _set(ready)
                    return _resp_dec.decode(earlier)
        call = RolloutCall(req, self.call_parts, handed_in, events)
        fut: asyncio.Future[bytes | None] | None = None
        if rid is not None:  # from here on, a retry waits for this attempt
            fut = asyncio.get_running_loop().create_future()
            calls.attempts[rid] = fut
        outcome: bytes | None = None
        try:
            # The background gives way to every call: the groups still generating that the
            # call takes over keep generating, the rest are buffered again, claimable.
            async with self.background.yielding():
                try:
                    await call.prepare()
                    _set(ready)
                    resp = await call.run()
                    outcome = _enc.encode(resp)
                    return resp
                finally:
                    call.close()
        finally:
            if rid is not None and fut is not None:
                calls.attempts.pop(rid, None)
                fut.set_result(outcome)  # None: not delivered, a waiting retry runs again


def _set(ready: asyncio.Future[None] | None) -> None:
    if ready is not None and not ready.done():
        ready.set_result(None)
