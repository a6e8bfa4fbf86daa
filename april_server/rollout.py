"""One APRIL step: `POST /april/v1/rollouts`.

1. Validate the request and build its new groups (nothing is started on bad input).
2. Claim buffered groups (oldest first, when `resume_first`) and then the new ones.
3. Start groups up to `max_inflight_groups` and refill as groups end.
4. Count whole groups as they finish, in finish order; stop at `target_groups` accepted.
5. Abort every sample of this call still generating, and wait until none is.
6. Answer exactly `target_groups` finished groups; surplus finished groups and unfinished ones
   go to the buffer (`on_quota: drop` discards the unfinished ones that had started).
7. Persist the buffer and the response (one fsynced commit) before answering.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

from april_server import samples as S
from april_server.errors import bad_request, conflict
from april_server.manager import CallTally
from april_server.protocol import (
    Group,
    GroupFinishedEvent,
    OnQuota,
    RejectReq,
    RolloutReq,
    RolloutResp,
    RolloutStats,
    StreamEvent,
)

if TYPE_CHECKING:
    from april_server.manager import RolloutManager

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


def new_groups(mgr: RolloutManager, req: RolloutReq) -> list[Group]:
    """Validate the request's groups and build them; raises ApiError, changes nothing."""
    seen: set[str] = set()
    built = []
    for spec in req.groups:
        if spec.group_id in seen:
            raise bad_request("duplicate_group_id", f"group_id {spec.group_id!r} is repeated")
        seen.add(spec.group_id)
        if spec.group_id in mgr.groups:
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
    def __init__(self, mgr: RolloutManager, req: RolloutReq) -> None:
        self.mgr = mgr
        self.req = req
        self.batch_id = f"b-{uuid.uuid4().hex[:12]}"
        self.quota = QuotaTracker(req.target_groups)
        self.tally = CallTally()
        self.group_ids: list[str] = []
        self.events: asyncio.Queue[StreamEvent | None] | None = None
        self.started: set[str] = set()
        self.stopped = False
        self.wakeup = asyncio.Event()
        self.inflight_target: int | None = None
        self.peak_running = 0
        self.discarded: list[Group] = []

    def prepare(self) -> None:
        """Steps 1-2: validation and claiming. Raises ApiError before anything starts."""
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
        fresh = new_groups(mgr, req)
        buffered = [g.group_id for g in mgr.idle_groups()] if req.resume_first else []
        available = len(buffered) + len(fresh)
        if req.target_groups > available:
            raise bad_request(
                "invalid_target",
                f"target_groups {req.target_groups} exceeds the {available} groups available "
                f"({len(fresh)} sent, {len(buffered)} buffered and idle)",
            )
        self.group_ids = buffered + [g.group_id for g in fresh]
        mgr.claim(self.group_ids, self.batch_id)
        for g in fresh:
            mgr.groups[g.group_id] = g
        mgr.calls[self.batch_id] = self

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
        """Steps 3-7. `prepare()` must have succeeded."""
        mgr, req = self.mgr, self.req
        t0 = time.perf_counter()
        limit, sample_target = await self._inflight_limits()
        pending = deque(self.group_ids)
        tasks: dict[asyncio.Task[None], str] = {}
        active: dict[str, int] = {}
        time_to_quota = None
        cancelled = False
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
                while pending and len(active) < limit and not self.quota.met:
                    # Groups start whole; the running target is a ceiling, not a hint (a
                    # group larger than the target may still run alone).
                    need = sum(not S.is_finished(s) for s in mgr.groups[pending[0]].samples)
                    if tasks and len(tasks) + need > sample_target:
                        break
                    gid = pending.popleft()
                    started = self._start_group(gid, tasks)
                    if started:
                        active[gid] = started
                        self.peak_running = max(self.peak_running, len(tasks))
                    elif S.group_finished(mgr.groups[gid]):
                        self._emit_finished(gid)
                if self.quota.met:
                    continue
                if not tasks:
                    break  # nothing generating and nothing left: the quota is out of reach
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                self._collect(done, tasks, active)
        except asyncio.CancelledError:
            cancelled = True  # the caller went away: keep everything, acknowledge nothing
        # Steps 5-7 run to the end even if we are cancelled again meanwhile (a client that
        # disconnects can cancel more than once): half a wind-down would leave requests
        # generating or a buffer that differs from the disk.
        wind_down = asyncio.ensure_future(self._wind_down(t0, time_to_quota, cancelled))
        while True:
            try:
                resp = await asyncio.shield(wind_down)
                break
            except asyncio.CancelledError:
                if wind_down.done() and wind_down.cancelled():
                    raise
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        return resp

    async def _inflight_limits(self) -> tuple[int, int]:
        """(max groups, max running samples) for this call. An integer pins the groups;
        "auto" sizes the running batch from the engine's measured step-time curve."""
        req, mgr = self.req, self.mgr
        if req.max_inflight_groups != "auto":
            self.inflight_target = None
            return req.max_inflight_groups, 1 << 30
        unfinished = [
            sum(not S.is_finished(s) for s in mgr.groups[g].samples) for g in self.group_ids
        ]
        sizes = sorted(len(mgr.groups[g].samples) for g in self.group_ids)
        demand = sum(sizes[-req.target_groups :])  # what a synchronous step would run
        decision = await mgr.inflight_decision(demand, max(sum(unfinished), 1))
        self.inflight_target = decision.running_target
        return len(self.group_ids), decision.running_target

    async def _wind_down(
        self, t0: float, time_to_quota: float | None, cancelled: bool
    ) -> RolloutResp:
        mgr = self.mgr
        self.stopped = True
        # Step 5: nothing of this call may keep generating.
        runs = [r for r in list(mgr.running.values()) if r.owner == self.batch_id]
        keep: OnQuota | None = "snapshot" if self.req.on_quota == "snapshot" else None
        await mgr.stop_running(runs, keep)
        resp = self._finish(time.perf_counter() - t0, time_to_quota, deliver=not cancelled)
        for g in self.discarded:  # their KV snapshots go with them
            for sample in g.samples:
                await mgr.snapshots.forget(sample)
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

    def _finish(self, wall_s: float, time_to_quota: float | None, deliver: bool) -> RolloutResp:
        """Steps 6-7: split groups, persist, build the response. With `deliver=False` (the
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
        if on_quota == "snapshot" and not mgr.snapshots.enabled:
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
        call = (
            None if req.request_id is None or not deliver else (req.request_id, _enc.encode(resp))
        )
        # Dropped groups and returned ones leave the server: so do their KV snapshots.
        self.discarded = [mgr.groups[g] for g in dropped + returned]
        mgr.persist([mgr.groups[g] for g in buffered], returned + dropped, call)
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
    """Run one call, honouring `request_id` idempotency (a retry gets the same response)."""
    mgr.counters.rollout_calls += 1
    rid = req.request_id
    if rid is not None:
        stored = mgr.store.load_call(rid)
        if stored is not None:
            _set(ready)
            return _resp_dec.decode(stored)
        if rid in mgr.inflight_requests:
            _set(ready)
            return _resp_dec.decode(await asyncio.shield(mgr.inflight_requests[rid]))
    call = RolloutCall(mgr, req)
    call.events = events
    call.prepare()
    _set(ready)
    fut: asyncio.Future[bytes] | None = None
    if rid is not None:
        fut = asyncio.get_running_loop().create_future()
        mgr.inflight_requests[rid] = fut
    try:
        resp = await call.run()
        if fut is not None:
            fut.set_result(_enc.encode(resp))
        return resp
    except BaseException as exc:
        if fut is not None and not fut.done():
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: a waiting retry re-raises it itself
        raise
    finally:
        call.close()
        if rid is not None:
            mgr.inflight_requests.pop(rid, None)


def _set(ready: asyncio.Future[None] | None) -> None:
    if ready is not None and not ready.done():
        ready.set_result(None)
