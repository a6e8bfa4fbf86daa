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
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

from april_server import samples as S
from april_server.buffer_index import BufferEntry, open_footprint
from april_server.errors import bad_request, conflict
from april_server.ids import check_id
from april_server.inflight import kv_need
from april_server.manager import run_to_end
from april_server.protocol import (
    Group,
    GroupFinishedEvent,
    GroupSpec,
    Keep,
    RejectReq,
    RolloutReq,
    RolloutResp,
    RolloutStats,
    StreamEvent,
)
from april_server.segments import CallTally

if TYPE_CHECKING:
    from april_server.manager import RolloutManager

logger = logging.getLogger(__name__)
MAX_REJECT_GRACE_S = 60.0
_enc = msgspec.json.Encoder()
_resp_dec = msgspec.json.Decoder(RolloutResp)


class QuotaTracker:
    """Finish order and acceptance of groups within one call (DAPO rejects un-count)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.finished: list[str] = []  # finish order, rejected ones included
        self.rejected: set[str] = set()

    @property
    def accepted(self) -> list[str]:
        return [g for g in self.finished if g not in self.rejected]

    @property
    def met(self) -> bool:
        return len(self.accepted) >= self.target

    def finish(self, group_id: str) -> None:
        self.finished.append(group_id)

    def reject(self, group_ids: list[str]) -> None:
        unknown = [g for g in group_ids if g not in self.finished]
        if unknown:
            raise conflict("not_finished", f"only finished groups can be rejected: {unknown}")
        self.rejected.update(group_ids)


YIELD_EVERY = 256  # groups validated between two yields to the event loop


async def new_groups(
    mgr: RolloutManager, specs: list[GroupSpec], handed_in: frozenset[str] = frozenset()
) -> list[Group]:
    """Validate the request's groups and build them; raises ApiError, changes nothing. A big
    call yields to the event loop as it goes, so other requests are not held up. Groups in
    `handed_in` (an earlier attempt of the same `request_id` already handed them in) are
    checked for their id only, and not built again."""
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
        built.append(S.build_group(spec, prompt, mgr.engine.context_len, mgr.engine.vocab_size))
    return built


class RolloutCall:
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
        fresh = await new_groups(mgr, req.groups, self.handed_in)
        for g in fresh:  # the validation yielded: another call may have sent the same id
            if mgr.buffer.known(g.group_id):
                raise conflict("group_exists", f"group {g.group_id!r} is already known")
        # A retry takes back what its earlier attempt left idle in the buffer; those another
        # call holds or already delivered are not this call's to run again.
        again = [s.group_id for s in req.groups if s.group_id in self.handed_in]
        again = [gid for gid in again if gid in mgr.buffer.idle]
        buffered = len(mgr.buffer.idle) if req.resume_first else len(again)
        available = buffered + len(fresh)
        if req.target_groups > available:
            raise bad_request(
                "invalid_target",
                f"target_groups {req.target_groups} exceeds the {available} groups available "
                f"({len(fresh)} sent, {buffered} buffered and idle)",
            )
        mgr.calls[self.batch_id] = self
        if again:  # claimed whole now, started before anything else
            taken = await mgr.buffer.claim(again, self.batch_id, busy_code="group_busy")
            self.ready.extend(g.group_id for g in taken)
            self.group_ids.extend(g.group_id for g in taken)
        # Sent groups are this call's from now on; buffered ones are claimed as it needs them
        # (`_next_group`), so the rest stay available to other calls.
        mgr.buffer.adopt(fresh, self.batch_id)
        self.group_ids.extend(g.group_id for g in fresh)
        self.fresh = deque(g.group_id for g in fresh)

    def reject(self, body: RejectReq) -> None:
        if self.stopped:
            raise conflict("batch_done", f"batch {self.batch_id!r} already reached its quota")
        self.quota.reject(body.group_ids)
        self.wakeup.set()

    def _emit_finished(self, gid: str) -> None:
        self.quota.finish(gid)
        if self.events is not None and len(self.quota.accepted) <= self.quota.target:
            event = GroupFinishedEvent(group=self.mgr.groups[gid], batch_id=self.batch_id)
            self.events.put_nowait(event)

    async def run(self) -> RolloutResp:
        """Steps 2-6. `prepare()` must have succeeded."""
        req = self.req
        t0 = time.perf_counter()
        limit, sample_target = await self._inflight_limits()
        await self.mgr.admission_ready()
        tasks = self.tasks
        active: dict[str, int] = {}
        time_to_quota = None
        cancelled = False
        failure: Exception | None = None
        grace_until: float | None = None
        try:
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
                if not tasks:
                    break  # nothing generating and nothing left: the quota is out of reach
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                self._collect(done, tasks, active)
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

    async def _refill(
        self,
        tasks: dict[asyncio.Task[None], str],
        active: dict[str, int],
        limit: int,
        sample_target: int,
    ) -> None:
        """Step 2: start groups whole, in order, while under the running target, the groups
        limit and the engine's admission bound."""
        mgr = self.mgr
        while len(active) < limit and not self.quota.met:
            gid = await self._next_group(len(tasks), len(active), limit, sample_target)
            if gid is None:
                return
            started = self._start_group(gid, tasks)
            if started:
                active[gid] = started
                self.peak_running = max(self.peak_running, len(tasks))
            elif S.group_finished(mgr.groups[gid]):
                self._emit_finished(gid)

    async def _next_group(
        self, running: int, active: int, limit: int, sample_target: int
    ) -> str | None:
        """The next group to start, if it fits: buffered ones first (oldest first, claimed now,
        as many as fit at once), then the sent ones. None: wait for a running group to end."""
        mgr = self.mgr
        if not self.ready and self.req.resume_first and len(mgr.buffer.idle):
            await self._claim_buffered(running, active, limit, sample_target)
            if not self.ready and len(mgr.buffer.idle):
                return None  # the oldest buffered group does not fit yet
        queue = self.ready or self.fresh
        if not queue:
            return None
        group = mgr.groups[queue[0]]
        unfinished, context, left = open_footprint(group)
        need = kv_need(context, left)
        # Groups start whole; the running target is a ceiling, not a hint (a group larger
        # than the target may still run alone).
        if running and (
            running + unfinished > sample_target or not mgr.admission.fits(unfinished, need)
        ):
            return None
        return queue.popleft()

    async def _claim_buffered(
        self, running: int, active: int, limit: int, sample_target: int
    ) -> None:
        """Claim the oldest idle groups that fit now (finished ones while the quota can use
        them); they leave the index at once, their bodies are read off the event loop."""
        mgr = self.mgr
        room_samples = room_groups = 0
        room_tokens = 0.0
        finished_wanted = self.quota.target - len(self.quota.accepted)

        def fits(e: BufferEntry) -> bool:
            nonlocal finished_wanted, room_samples, room_groups, room_tokens
            if e.unfinished == 0:  # a surplus finished group: no engine work, counts at once
                finished_wanted -= 1
                return finished_wanted >= 0
            need = kv_need(e.context_tokens, e.remaining_tokens)
            first = running == 0 and room_groups == 0
            if not first and (
                active + room_groups >= limit
                or running + room_samples + e.unfinished > sample_target
                or not mgr.admission.fits(room_samples + e.unfinished, room_tokens + need)
            ):
                return False
            room_samples += e.unfinished
            room_tokens += need
            room_groups += 1
            return True

        picked = mgr.buffer.pick_oldest(fits)
        if picked:
            groups = await mgr.buffer.claim_entries(picked, self.batch_id)
            self.ready.extend(g.group_id for g in groups)
            self.group_ids.extend(g.group_id for g in groups)

    async def _inflight_limits(self) -> tuple[int, int]:
        """(max groups, max running samples) for this call. An integer pins the groups;
        "auto" sizes the running batch from the engine's measured step-time curve."""
        req, mgr = self.req, self.mgr
        if req.max_inflight_groups != "auto":
            self.inflight_target = None
            return req.max_inflight_groups, 1 << 30
        # O(target + sent), not O(buffer): the index keeps the buffered counts.
        sizes = [len(mgr.groups[gid].samples) for gid in self.ready][: req.target_groups]
        if req.resume_first:
            for e in mgr.buffer.idle.oldest():
                if len(sizes) >= req.target_groups:
                    break
                sizes.append(e.num_samples)
        for gid in self.fresh:
            if len(sizes) >= req.target_groups:
                break
            sizes.append(len(mgr.groups[gid].samples))
        demand = sum(sizes)  # what a synchronous step would run
        can_run = sum(len(mgr.groups[g].samples) for g in [*self.ready, *self.fresh])
        if req.resume_first:
            can_run += mgr.buffer.idle.unfinished_samples
        decision = await mgr.inflight_decision(demand, max(can_run, 1))
        self.inflight_target = decision.running_target
        return 1 << 30, decision.running_target

    async def _wind_down(
        self, t0: float, time_to_quota: float | None, deliver: bool
    ) -> RolloutResp:
        mgr = self.mgr
        self.stopped = True
        # Step 4: nothing of this call may keep generating.
        runs = [r for r in list(mgr.running.values()) if r.owner == self.batch_id]
        # `continue`: its stragglers stop with a snapshot here and go on in the background
        # (background.py), restoring it.
        keep: Keep | None = "snapshot" if self.req.on_quota in ("snapshot", "continue") else None
        await mgr.stop_running(runs, keep)
        # A segment leaves `running` when its request returned but still records its end
        # (tokens, the snapshot taken) a few awaits later: persisting before that would store
        # the group without it and lose track of the snapshot.
        ending = [t for t in self.tasks if not t.done()]
        if ending:
            await asyncio.wait(ending)
        resp = await self._finish(time.perf_counter() - t0, time_to_quota, deliver)
        for g in self.discarded:  # their KV snapshots go with them
            for sample in g.samples:
                await mgr.segments.forget(sample)
        return resp

    def _collect(
        self, done: set[Any], tasks: dict[asyncio.Task[None], str], active: dict[str, int]
    ) -> None:
        """Account for finished segment tasks; a group counts once all its members ended."""
        for t in done:
            gid = tasks.pop(t)
            active[gid] -= 1
            if active[gid] == 0:
                del active[gid]
                if S.group_finished(self.mgr.groups[gid]):
                    self._emit_finished(gid)

    def _start_group(self, gid: str, tasks: dict[asyncio.Task[None], str]) -> int:
        group = self.mgr.groups[gid]
        n = 0
        for s in group.samples:
            if S.is_finished(s):
                continue
            if S.remaining_budget(s) <= 0:
                s.status, s.finish_reason = "truncated", "length"
                continue
            t = self.mgr.start_sample(s, self.batch_id, self.tally, self.req.max_staleness)
            tasks[t] = gid
            n += 1
        if n:
            self.started.add(gid)
        return n

    async def _finish(
        self, wall_s: float, time_to_quota: float | None, deliver: bool
    ) -> RolloutResp:
        """Steps 5-6: split groups, persist, build the response. With `deliver=False` (the
        caller is gone) nothing is returned, so every group goes back to the buffer."""
        mgr, req = self.mgr, self.req
        version = mgr.current_version()
        accepted = self.quota.accepted
        returned = accepted[: req.target_groups] if deliver else []
        dropped = sorted(self.quota.rejected)
        buffered = []
        for gid in self.group_ids:
            if gid in returned or gid in self.quota.rejected:
                continue
            unfinished = not S.group_finished(mgr.groups[gid])
            if req.on_quota == "drop" and unfinished and gid in self.started:
                dropped.append(gid)
            else:
                buffered.append(gid)
        groups = [mgr.groups[g] for g in returned]
        notes = list(self.tally.notes)
        on_quota = req.on_quota
        if on_quota == "snapshot" and not mgr.segments.snapshots_enabled:
            on_quota = "tokens"
            notes.append("on_quota=snapshot ran as tokens: this engine keeps no KV snapshots")
        stats = RolloutStats(
            wall_s=round(wall_s, 4),
            weight_version=version,
            num_finished_groups=len(returned),
            num_buffered_groups=len(buffered),
            output_tokens=self.tally.output_tokens,
            offpolicy_tokens=sum(S.offpolicy_tokens(g, version) for g in groups),
            resumed_samples=self.tally.resumed_samples,
            restored_kv_tokens=self.tally.restored_kv_tokens,
            recomputed_tokens=self.tally.recomputed_tokens,
            quota_met=len(returned) == req.target_groups,
            num_rejected_groups=len(self.quota.rejected),
            num_dropped_groups=len(dropped) - len(self.quota.rejected),
            time_to_quota_s=None if time_to_quota is None else round(time_to_quota, 4),
            on_quota_effective=on_quota,
            inflight_target=self.inflight_target,
            num_started_groups=len(self.started),
            peak_running_samples=self.peak_running,
            offpolicy_fraction=round(
                sum(S.offpolicy_tokens(g, version) for g in groups)
                / max(1, sum(len(s.output_ids) for g in groups for s in g.samples)),
                4,
            ),
            notes=notes,
        )
        resp = RolloutResp(
            batch_id=self.batch_id,
            groups=groups,
            buffered_group_ids=buffered,
            stats=stats,
            dropped_group_ids=dropped,
        )
        call = None
        if req.request_id is not None:
            # Delivered: the response, for retries. Not delivered (the caller went away, or a
            # bug): which sent groups this attempt handed in, so a retry runs again on them.
            body = _enc.encode(resp) if deliver else attempt_record(req)
            call = (req.request_id, body)
        # Dropped groups and returned ones leave the server: so do their KV snapshots.
        self.discarded = [mgr.groups[g] for g in dropped + returned]
        await mgr.persist([mgr.groups[g] for g in buffered], returned + dropped, call)
        mgr.background.forget(returned + dropped)  # they left the server
        if req.on_quota == "continue":  # they go on generating once this call has ended
            going_on = [g for g in buffered if g in self.started]
            mgr.background.add(
                [g for g in going_on if not S.group_finished(mgr.groups[g])], req.max_staleness
            )
        mgr.counters.returned_groups += len(returned)
        mgr.counters.dropped_groups += len(dropped)
        return resp

    def close(self) -> None:
        self.mgr.calls.pop(self.batch_id, None)
        self.mgr.remember_batch(self.batch_id)
        self.mgr.release(self.batch_id)


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
        # The background gives way to every call: its groups are buffered again, claimable.
        async with mgr.background.paused():
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


_ATTEMPT = b"attempt:"  # a `calls` row that holds no response, only what an attempt handed in
_ids_enc = msgspec.json.Encoder()
_ids_dec = msgspec.json.Decoder(list[str])


def attempt_record(req: RolloutReq) -> bytes:
    return _ATTEMPT + _ids_enc.encode([g.group_id for g in req.groups])


def is_attempt(stored: bytes) -> bool:
    return stored.startswith(_ATTEMPT)


def handed_in_by(stored: bytes) -> frozenset[str]:
    return frozenset(_ids_dec.decode(stored[len(_ATTEMPT) :]))


def _set(ready: asyncio.Future[None] | None) -> None:
    if ready is not None and not ready.done():
        ready.set_result(None)
