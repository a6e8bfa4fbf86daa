"""One APRIL step: `POST /april/v1/rollouts`.

1. Validate the request and build its new groups (nothing is started on bad input).
2. Start groups whole, in order: buffered ones first (oldest first, when `resume_first`),
   claimed from the buffer only as the call starts them, then the new ones; under the
   running target (`max_inflight_groups`) and the engine's admission bound, refilled as
   groups end.
3. Count whole groups as they finish, in finish order; stop at `target_groups` accepted.
4. Abort every sample of this call still generating, and wait until none is.
5. Answer exactly `target_groups` finished groups; surplus finished groups and unfinished ones
   go to the buffer (`on_quota: drop` discards the unfinished ones that had started).
6. Persist the buffer and the response (one fsynced commit, off the event loop) before
   answering.
7. With `on_quota: continue`, the unfinished groups it started go on generating in the
   background (`background.py`): in place, never stopped at 4, where nothing else holds it.

Where each step lives: 1 and the run loop here; 2-3 in `refill.py`; 4-7 in `wind_down.py`,
where a call ends and the background begins. What a call holds: `state.py`; the quota:
`quota.py`; `request_id` retries: `idempotency.py`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from typing import TYPE_CHECKING

import msgspec

from april_client.protocol import (
    Group,
    GroupSpec,
    RejectReq,
    RolloutReq,
    RolloutResp,
    StreamEvent,
    TurnsSpec,
)
from april_server.calls.refill import Refill
from april_server.calls.wind_down import WindDown
from april_server.engine.segment_state import BACKGROUND
from april_server.rules import samples as S
from april_server.rules.idempotency import handed_in_by, is_attempt
from april_server.rules.routing import check_wanted as check_routing
from april_server.rules.turns import check_spec
from april_server.runtime.manager import run_to_end
from april_server.wire.errors import bad_request, conflict
from april_server.wire.ids import check_id

if TYPE_CHECKING:
    from april_server.runtime.manager import RolloutManager

logger = logging.getLogger(__name__)
MAX_REJECT_GRACE_S = 60.0
_enc = msgspec.json.Encoder()
_resp_dec = msgspec.json.Decoder(RolloutResp)


YIELD_EVERY = 256  # groups validated between two yields to the event loop


async def new_groups(
    mgr: RolloutManager,
    specs: list[GroupSpec],
    handed_in: frozenset[str] = frozenset(),
    turns: TurnsSpec | None = None,
    routing: bool = False,
) -> list[Group]:
    """Validate the request's groups and build them; raises ApiError, changes nothing. A big
    call yields to the event loop as it goes, so other requests are not held up. Groups in
    `handed_in` (an earlier attempt of the same `request_id` already handed them in) are
    checked for their id only, and not built again. `turns`: the call's turn rule, for
    groups that carry none; `routing`: the call's `return_routed_experts`."""
    check_spec(turns, "turns", mgr.engine.vocab_size)
    seen: set[str] = set()
    built = []
    for i, spec in enumerate(specs):
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
        check_id("group_id", spec.group_id)
        if spec.group_id in seen:
            raise bad_request("duplicate_group_id", f"group_id {spec.group_id!r} is repeated")
        seen.add(spec.group_id)
        if spec.group_id in handed_in:
            continue
        if mgr.buffer.known(spec.group_id):
            raise conflict("group_exists", f"group {spec.group_id!r} is already known")
        if (spec.input_ids is None) == (spec.text is None):
            raise bad_request(
                "invalid_prompt", f"group {spec.group_id!r}: give exactly one of input_ids, text"
            )
        prompt = spec.input_ids
        if prompt is None:
            prompt = mgr.engine.tokenize(spec.text or "")
        if spec.seed is None and mgr.engine.assigns_seeds:
            spec = msgspec.structs.replace(spec, seed=secrets.randbelow(2**31 - 2**16))
        for params in [spec.sampling_params, *(spec.member_params or [])]:
            mgr.engine.check_sampling_params({k: v for k, v in params.items()})
        check_spec(spec.turns, f"group {spec.group_id!r}: turns", mgr.engine.vocab_size)
        wants = routing if spec.return_routed_experts is None else spec.return_routed_experts
        check_routing(wants, mgr.engine.routing_format, f"group {spec.group_id!r}")
        group = S.build_group(
            spec, prompt, mgr.engine.context_len, mgr.engine.vocab_size, turns, routing
        )
        _check_as_sent(mgr, group)
        built.append(group)
    return built


def _check_as_sent(mgr: RolloutManager, group: Group) -> None:
    """What each member's first segment sends (its params over the group's, the turn stops,
    its budget, its seed) must pass SGLang's checks too, or every segment of it fails after a
    200 and it never finishes: e.g. 33 stop strings, `min_new_tokens` over a member's budget,
    a seed past int64. Each distinct set of params is checked once."""
    checked: set[bytes] = set()
    for s in group.samples:
        if s.seed is not None and not -(2**63) <= s.seed < 2**63:
            raise bad_request(
                "invalid_sampling_params",
                f"group {group.group_id!r}: member {s.index}'s seed {s.seed} (seed + index) "
                "is outside int64",
            )
        floor = s.sampling_params.get("min_new_tokens") or 0
        if isinstance(floor, int) and floor > s.max_new_tokens:  # a continuation caps it
            raise bad_request(
                "invalid_sampling_params",
                f"group {group.group_id!r}: member {s.index}'s min_new_tokens {floor} exceeds "
                f"its max_new_tokens {s.max_new_tokens}",
            )
        key = _enc.encode((s.sampling_params, s.max_new_tokens))
        if key in checked:
            continue
        checked.add(key)
        params = S.plan_continuation(s, "", None).sampling_params
        params.pop("sampling_seed", None)
        mgr.engine.check_sampling_params(params)


class RolloutCall(Refill, WindDown):
    def __init__(
        self, mgr: RolloutManager, req: RolloutReq, handed_in: frozenset[str] = frozenset()
    ) -> None:
        super().__init__(mgr, req, handed_in)

    async def prepare(self) -> None:
        """Step 1: validation. Raises ApiError before anything starts."""
        req, mgr = self.req, self.mgr
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
            mgr, req.groups, self.handed_in, req.turns, req.return_routed_experts
        )
        await self._settle_own_groups()
        # From here to the claims below nothing awaits: what is decided is what is taken.
        for g in fresh:  # the validation yielded: another call may have sent the same id
            if mgr.buffer.known(g.group_id):
                raise conflict("group_exists", f"group {g.group_id!r} is already known")
        # A retry takes back what its earlier attempt left in the buffer; those another call
        # holds or already delivered are not this call's to run again.
        again = [
            s.group_id
            for s in req.groups
            if s.group_id in self.handed_in
            and s.group_id in mgr.buffer.idle
            and mgr.buffer.owner_of(s.group_id) is None
        ]
        # Groups waiting only for answers are not available: nothing of them can run.
        buffered = mgr.buffer.idle.claimable if req.resume_first else len(again)
        available = buffered + len(fresh)
        if req.target_groups > available:
            raise bad_request(
                "invalid_target",
                f"target_groups {req.target_groups} exceeds the {available} groups available "
                f"({len(fresh)} sent, {buffered} buffered and idle)",
            )
        mgr.calls[self.batch_id] = self
        # Sent groups are this call's from now on; buffered ones are claimed as it needs them
        # (`_next_group`), so the rest stay available to other calls.
        mgr.buffer.adopt(fresh, self.batch_id)
        self.group_ids.extend(g.group_id for g in fresh)
        entries = mgr.buffer.take(again, self.batch_id, busy_code="group_busy")
        # New groups start in the call's length order (predicted longest first: the tail
        # begins early and short ones fill the batch; docs/api.md, Length prediction).
        lengths = mgr.segments.lengths
        order = lengths.order(fresh, req.length_order or lengths.default_order)
        self.fresh = deque(g.group_id for g in order)
        if again:  # claimed whole now, started before anything else
            taken = await self._arrive(entries)
            self.ready.extend(g.group_id for g in taken)
            await mgr.background.restart_stale(taken, self.tally)

    async def _settle_own_groups(self) -> None:
        """Before a retry decides which of its own groups it runs again: wait out an
        operation that holds one now (an answer being made durable, a resume, a delete), and
        have the background give back those it runs; groups another call holds are left to
        it. Their holders are read from the map again after every wait."""
        mgr, buf = self.mgr, self.mgr.buffer
        own = [s.group_id for s in self.req.groups if s.group_id in self.handed_in]
        gave_way = False
        while own:
            holders = [h for gid in own if (h := buf.holders.get(gid)) is not None]
            busy = [h for h in holders if h.owner not in mgr.calls and h.owner != BACKGROUND]
            if busy:
                await busy[0].released.wait()
            elif not gave_way and any(h.owner == BACKGROUND for h in holders):
                await mgr.background.give_way()  # buffered again first
                gave_way = True
            else:
                return

    def reject(self, body: RejectReq) -> None:
        if self.stopped:
            raise conflict("batch_done", f"batch {self.batch_id!r} already reached its quota")
        self.quota.reject(body.group_ids)
        self.wakeup.set()

    async def run(self) -> RolloutResp:
        """Steps 2-6. `prepare()` must have succeeded."""
        req = self.req
        t0 = time.perf_counter()
        tasks = self.tasks
        active = self.active
        time_to_quota = None
        cancelled = False
        failure: Exception | None = None
        grace_until: float | None = None
        try:
            # Inside the try: the caller may already hold a started stream (its groups are
            # acknowledged), so a cancellation even here must wind down and keep them.
            limit, sample_target = await self._inflight_limits()
            await self._take_over_background(tasks, active, limit, sample_target)
            await self.mgr.admission_ready()
            while True:
                if self.quota.met:
                    # Streamed calls may wait `reject_grace_s` for late rejects (DAPO
                    # filtering); generation goes on meanwhile.
                    now = time.perf_counter()
                    if time_to_quota is None:
                        time_to_quota = now - t0
                    if grace_until is None:
                        grace_until = now + (req.reject_grace_s if req.stream else 0.0)
                    if now >= grace_until:
                        break
                    self.wakeup.clear()
                    waiter = asyncio.ensure_future(self.wakeup.wait())
                    done, _ = await asyncio.wait(
                        [*tasks, waiter],
                        timeout=grace_until - now,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    waiter.cancel()
                    self._collect(done - {waiter}, tasks, active)
                    continue
                grace_until = None  # a reject re-opened the quota
                time_to_quota = None
                await self._refill(tasks, active, limit, sample_target)
                if self.quota.met:
                    continue
                if not tasks and not self._waits_for_input():
                    break  # nothing generating and nothing left: the quota is out of reach
                # Woken by a segment's end, or by an answer that started one (turns_in_call.py).
                self.wakeup.clear()
                waiter = asyncio.ensure_future(self.wakeup.wait())
                done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                self._collect(done - {waiter}, tasks, active)
        except asyncio.CancelledError:
            cancelled = True  # the caller went away: keep everything, acknowledge nothing
        except Exception as exc:  # a bug: the caller gets a 500, its groups stay buffered
            logger.exception(
                "april: rollout %s failed; its groups go back to the buffer", self.batch_id
            )
            failure = exc
        # Steps 4-6 run to the end even if we are cancelled again meanwhile (a client that
        # disconnects can cancel more than once): half a wind-down would leave requests
        # generating or a buffer that differs from the disk.
        delivered = not cancelled and failure is None
        resp = await run_to_end(self._wind_down(t0, time_to_quota, delivered))
        if failure is not None:
            raise failure
        if cancelled:
            raise asyncio.CancelledError
        return resp

    def close(self) -> None:
        self.mgr.calls.pop(self.batch_id, None)
        self.mgr.remember_batch(self.batch_id)
        self.mgr.release(self.batch_id)
        self.closed.set()


async def rollout(
    mgr: RolloutManager,
    req: RolloutReq,
    events: asyncio.Queue[StreamEvent | None] | None = None,
    ready: asyncio.Future[None] | None = None,
) -> RolloutResp:
    """Run one call, honouring `request_id` idempotency: a retry gets the response of the
    attempt that delivered one; if none did (its caller went away, or it failed), the retry
    runs again, on the groups the earlier attempt handed in."""
    mgr.counters.rollout_calls += 1
    rid = req.request_id
    handed_in: frozenset[str] = frozenset()
    if rid is not None:
        check_id("request_id", rid)
        while True:
            stored = await mgr.store.load_call(rid)
            if stored is not None and not is_attempt(stored):
                _set(ready)
                return _resp_dec.decode(stored)
            pending = mgr.inflight_requests.get(rid)
            if pending is None:
                handed_in = frozenset() if stored is None else handed_in_by(stored)
                break
            earlier = await asyncio.shield(pending)  # another attempt of this id is running
            if earlier is not None:
                _set(ready)
                return _resp_dec.decode(earlier)
    call = RolloutCall(mgr, req, handed_in)
    call.events = events
    fut: asyncio.Future[bytes | None] | None = None
    if rid is not None:  # from here on, a retry waits for this attempt
        fut = asyncio.get_running_loop().create_future()
        mgr.inflight_requests[rid] = fut
    outcome: bytes | None = None
    try:
        # The background gives way to every call: the groups still generating that the call
        # takes over keep generating, the rest are buffered again, claimable.
        async with mgr.background.yielding():
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
            mgr.inflight_requests.pop(rid, None)
            fut.set_result(outcome)  # None: not delivered, a waiting retry runs again


def _set(ready: asyncio.Future[None] | None) -> None:
    if ready is not None and not ready.done():
        ready.set_result(None)
