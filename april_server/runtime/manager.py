"""RolloutManager: owns the partial buffer, the running samples and every call's bookkeeping.

Plain Python over asyncio: no torch, no SGLang (the engine is a `BaseEngine`). Invariants,
checked by `check_integrity()`:
- every known sample is in exactly one group, and a group is either idle in the buffer or
  held by exactly one owner: a call, the background or an operation (`partial_buffer.py`'s
  holder map; idle groups are summaries, bodies on disk);
- a sample is generating in at most one engine request (`running`), of a claimed group, for
  that group's holder;
- the buffer on disk equals the idle groups after every acknowledged call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from april_client.protocol import (
    Group,
    Keep,
    Sample,
)
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.buffer.store import BufferStore
from april_server.engine.base import BaseEngine
from april_server.engine.clock import idle_shares
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import Counters, Running
from april_server.engine.versions import WeightVersions
from april_server.rules import samples as S
from april_server.rules import turns as turn_rules
from april_server.rules.inflight import (
    Admission,
    InflightDecision,
    StepCurve,
    StepStat,
    choose_running_target,
)
from april_server.rules.pool_size import PoolAdvisor
from april_server.runtime.background import OWNER as BACKGROUND
from april_server.runtime.background import Background
from april_server.runtime.loop_lag import LoopLagMonitor
from april_server.runtime.snapshot_sweep import SnapshotSweep
from april_server.wire.errors import not_found
from april_server.wire.ids import split_sample_id

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_REMEMBERED_BATCHES = 10_000


async def run_to_end(aw: Awaitable[T]) -> T:
    """Await `aw` to its end even if the caller is cancelled meanwhile (a client that goes
    away, possibly more than once), then re-raise the cancellation: half a call would leave
    requests generating, groups claimed, or a buffer that differs from the disk."""
    work = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(work)
            break
        except asyncio.CancelledError:
            if work.done() and work.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class RolloutManager:
    def __init__(
        self,
        engine: BaseEngine,
        store: BufferStore,
        allow_stale_kv: bool = False,
        buffer: PartialBuffer | None = None,
    ) -> None:
        """`buffer`: one already loaded from `store` (the server loads it at start-up)."""
        self.engine = engine
        self.store = store
        self.buffer = buffer if buffer is not None else PartialBuffer(store)
        self.calls: dict[str, Any] = {}  # batch_id -> live RolloutCall (see rollout.py)
        # request_id -> the running attempt's encoded response (None: it delivered none)
        self.inflight_requests: dict[str, asyncio.Future[bytes | None]] = {}
        # Recent batch ids, so an abort naming a finished call is a no-op, not a 404; bounded,
        # since a multi-day run makes millions of calls.
        self.finished_batches: OrderedDict[str, None] = OrderedDict()
        self.versions = WeightVersions(engine)
        self.version_history = self.versions.history
        self.counters = Counters()
        self.admission = Admission()  # shared by every call: what the engine is given
        self.segments = SegmentRunner(
            engine, self.counters, self.admission, allow_stale_kv, self.versions
        )
        self.running: dict[str, Running] = self.segments.running  # sample_id -> its request
        self.last_inflight: (
            tuple[InflightDecision, StepCurve, Mapping[int, float | StepStat]] | None
        ) = None
        self.pool_advisor = PoolAdvisor()  # `stats.groups_wanted` across calls (pool_size.py)
        self.loop_lag: LoopLagMonitor | None = None  # the server starts one (server.py)
        self.sweep: SnapshotSweep | None = None  # the server may start one (server.py)
        # Groups generating between calls: it gets what it works with, not the manager.
        self.background = Background(self.buffer, self.segments, self.calls)
        # POST /samples/{id}/input: one answer per group at a time (inputs.py).
        self.input_locks: dict[str, list[Any]] = {}

    @property
    def groups(self) -> dict[str, Group]:
        """The groups some call holds, in memory (idle ones are in `buffer.idle`)."""
        return self.buffer.claimed

    # ---- lookups -----------------------------------------------------------------------------

    def current_version(self) -> str:
        return self.versions.now()

    def sample(self, sample_id: str) -> Sample:
        """A sample of a claimed group (idle ones: `read_samples`)."""
        return _member(self.groups, sample_id, split_sample_id(sample_id))

    async def read_group(self, group_id: str) -> Group:
        return (await self.buffer.read([group_id]))[group_id]

    async def read_samples(self, sample_ids: list[str]) -> dict[str, Sample]:
        """Samples to show, claimed or idle; 404 for an unknown one."""
        parsed = {sid: split_sample_id(sid) for sid in sample_ids}
        gids = sorted({p[0] for p in parsed.values() if p is not None})
        groups = await self.buffer.read([g for g in gids if self.buffer.known(g)])
        out = {}
        for sid, parts in parsed.items():
            out[sid] = _member(groups, sid, parts)
        return out

    def idle_groups(self) -> list[Group]:
        """Every idle buffered group, oldest first. Reads the whole store: tests only."""
        return self.buffer.load_idle()

    def listed(self, g: Group) -> Group:
        g.age_s = round(time.time() - g.created_at, 3)
        if self.buffer.owner_of(g.group_id) == BACKGROUND or any(
            s.sample_id in self.running for s in g.samples
        ):
            g.state = "running"
        elif S.group_finished(g):
            g.state = "finished"
        else:
            g.state = "awaiting" if any(turn_rules.awaiting(s) for s in g.samples) else "idle"
            self.segments.lengths.mark(g)  # what it would start under now (running: as it did)
        return g

    # ---- claiming and persisting -------------------------------------------------------------

    def remember_batch(self, batch_id: str) -> None:
        self.finished_batches[batch_id] = None
        while len(self.finished_batches) > MAX_REMEMBERED_BATCHES:
            self.finished_batches.popitem(last=False)

    def release(self, owner: str) -> None:
        self.buffer.release(owner)

    async def persist(
        self, put: list[Group], delete: list[str], call: tuple[str, bytes] | None = None
    ) -> None:
        """Make the outcome durable (fsync, off the event loop); called before acknowledging."""
        running = self.running
        live = [g.group_id for g in put if any(s.sample_id in running for s in g.samples)]
        await self.buffer.persist(put, delete, call, live)
        dirty = self.segments.lengths.history.take_dirty()
        if dirty:
            self.store.save_lengths(dirty)

    def forget_lengths(self) -> int:
        """`DELETE /april/v1/lengths`: forget every prompt's length history (here and in the
        store) and what the pool advice remembers (it plays from those lengths: the next
        advice starts afresh); returns how many prompts it held."""
        n = self.segments.lengths.forget()
        self.store.save_lengths([], forget=True)
        self.pool_advisor = PoolAdvisor()
        return n

    async def admission_ready(self) -> Admission:
        return await self.segments.admission_ready()

    # ---- running segments (segment_runner.py) ---------------------------------------------

    async def stop_running(self, runs: list[Running], keep: Keep | None = None) -> None:
        """Abort `runs` and return only when none of them is generating any more."""
        await self.segments.stop(runs, keep)

    def _inflight_stats(self) -> dict[str, Any]:
        if self.last_inflight is None:
            return {"last_target": None}
        decision, curve, raw = self.last_inflight
        measured = {
            str(b): [m.steps, round(m.mean_s, 6), round(m.std_s, 6), round(m.mean_context, 1)]
            for b, m in sorted(raw.items())
            if isinstance(m, StepStat)
        }
        context = curve.context
        return {
            "last_target": decision.running_target,
            "reason": decision.reason,
            # What the decision used: at a common context, smoothed, thinly measured sizes
            # credited with the doubt.
            "step_time_s_by_batch": {str(b): round(t, 6) for b, t in sorted(curve.points.items())},
            # What the scheduler measured: [decode steps, mean s, std s, mean context tokens].
            "measured_by_batch": measured,
            "context_cost_s_per_token": None if context is None else context.cost_per_token_s,
            "context_per_sample": None if context is None else round(context.context_per_sample, 1),
        }

    async def inflight_decision(self, demand: int, cap: int) -> InflightDecision:
        raw = await self.engine.step_curve()
        curve = StepCurve.smoothed(raw)
        decision = choose_running_target(curve, demand, cap)
        self.last_inflight = (decision, curve, raw)
        return decision

    # ---- integrity ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant is broken. Valid at any moment between two
        callbacks (the simulator checks it there, `tests/sim`): the holder map is the one
        word on who holds a group, and every other view of it agrees with it."""
        buf = self.buffer
        for gid, g in self.groups.items():
            assert all(s.group_id == gid for s in g.samples), gid
            assert [s.index for s in g.samples] == list(range(len(g.samples))), gid
            for s in g.samples:
                assert len(s.output_ids) == len(s.output_logprobs), s.sample_id
                assert len(s.output_ids) <= s.max_new_tokens, s.sample_id
                covered = sum(seg.end - seg.start for seg in s.segments)
                assert covered == len(s.output_ids), s.sample_id
        for sid, r in self.running.items():
            assert r.sample.sample_id == sid
            gid = r.sample.group_id
            assert gid in self.groups, sid  # only claimed groups generate
            assert buf.owner_of(gid) == r.owner, (
                f"{sid} runs for {r.owner}, held by {buf.owner_of(gid)}"
            )
            assert self.groups[gid].samples[r.sample.index] is r.sample, f"{sid}: another body"
        for batch_id, call in self.calls.items():
            held = buf.held_by(batch_id)
            listed = set(call.group_ids)
            assert held <= listed, f"{batch_id} holds {sorted(held - listed)} it does not list"
            if not call.stopped:  # a call that ended may have handed groups on (wind_down.py)
                assert listed == held, f"{batch_id} lists {sorted(listed - held)} it does not hold"
        self.background.check()
        buf.check(in_place=BACKGROUND)

    async def stats(self) -> dict[str, Any]:
        idle = self.buffer.idle
        c = self.counters
        kv: dict[str, Any] = {"kv_snapshots": "disabled"}
        clock = await self.engine.engine_clock()
        snap_engine = self.segments.snap
        if snap_engine is not None:
            kv = {"kv_snapshots": "enabled", **await snap_engine.snapshot_stats()}
            kv.update({} if self.sweep is None else self.sweep.stats())
        return {
            "weight_version": self.current_version(),
            "buffered_groups": len(idle),
            "buffered_samples": idle.samples,
            "buffered_output_tokens": idle.output_tokens,
            "buffered_unfinished_groups": idle.unfinished_groups,
            "buffered_unfinished_samples": idle.unfinished_samples,
            "claimed_groups": len(self.groups),
            # Agent rollouts: members whose turn ended at a turn stop, waiting for an answer
            # (idle ones from the index; those a call holds, from memory).
            "awaiting_input_samples": idle.awaiting_samples
            + sum(
                1
                for gid, g in self.groups.items()
                if self.buffer.owner_of(gid) != BACKGROUND
                for s in g.samples
                if turn_rules.awaiting(s)
            ),
            **({} if self.loop_lag is None else self.loop_lag.figures()),
            "running_samples": len(self.running),
            "running_by_slot": self.segments.by_slot(),
            "active_calls": len(self.calls),
            "background_groups": len(self.background.wanted),
            "background_running_groups": len(self.background.running_groups()),
            "background_running_samples": sum(
                1 for r in self.running.values() if r.owner == BACKGROUND
            ),
            "background_output_tokens": self.background.tally.output_tokens,
            "background_pauses": self.background.pauses,
            "background_pause_s": round(self.background.pause_s, 6),
            **kv,
            **{k: getattr(c, k) for k in c.__dataclass_fields__},
            "engine": self.engine.engine_stats(),
            "engine_time": clock,
            **idle_shares(clock),
            "inflight_policy": self._inflight_stats(),
            "length_prediction": self.segments.lengths.figures(),
        }


def _member(groups: Mapping[str, Group], sample_id: str, parts: tuple[str, int] | None) -> Sample:
    """The member `sample_id` (parsed as `parts`) names in `groups`; 404 if none."""
    g = groups.get(parts[0]) if parts else None
    if parts is None or g is None or parts[1] >= len(g.samples):
        raise not_found(f"unknown sample_id {sample_id!r}")
    return g.samples[parts[1]]
