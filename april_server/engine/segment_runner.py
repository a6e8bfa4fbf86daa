"""Running segments: plan (pure), hand the plan to the engine (one call), record (pure).

A segment is one engine request of a sample: prompt + output so far as input, the remaining
budget. Starting one decides, without I/O, what it runs as (`samples.plan_continuation`),
whether its KV snapshot may be reused (`snapshots.usable`) and where it runs
(`placement.plan_segment`: the snapshot's slot, else the least loaded one); the engine then
performs the whole plan in one `run_segment` call (free an unused snapshot, restore, generate
pinned to the slot, release). Its end is recorded by `samples.apply_segment`, and
`snapshots.after_segment` says whether the snapshot the engine holds is kept or freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from april_client.protocol import Group, Keep, KvMode, Sample
from april_server.engine.base import (
    BaseEngine,
    EngineUnavailable,
    SegmentCall,
    SegmentOutcome,
    SnapshotEngine,
)
from april_server.engine.segment_state import BACKGROUND, CallTally, Counters, Running
from april_server.engine.versions import WeightVersions
from april_server.rules import samples as S
from april_server.rules import snapshots as K
from april_server.rules import turns as T
from april_server.rules.inflight import Admission, kv_need
from april_server.rules.lengths import LengthModel
from april_server.rules.placement import NoHealthySlot, Slot, SlotLoad, is_long, plan_segment
from april_server.rules.samples import SegmentResult
from april_server.rules.stops import reached_stop
from april_server.wire.errors import conflict

logger = logging.getLogger(__name__)

ABORT_POLL_S = 0.2  # how often an abort is re-sent while its request is still generating
# SGLang drops an abort for a request it has not registered yet (`abort_request` ignores an
# unknown rid), and a segment started a moment ago (e.g. one a weight update just continued)
# is often not registered yet when a call pauses the background: the first re-sends come
# soon, so a stop waits a few milliseconds for such a request rather than a whole poll.
ABORT_RESEND_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)
ENGINE_WAIT_S = 30.0  # how long a segment whose engine went away waits for a healthy one
HEALTH_POLL_S = 0.5


class _PlannedBeforeUpdate(Exception):
    """A segment held by a weight update before it started, planned under the old weights."""

    def __init__(self, call: SegmentCall) -> None:
        super().__init__(call.rid)
        self.call = call


class SegmentRunner:
    def __init__(
        self,
        engine: BaseEngine,
        counters: Counters,
        admission: Admission,
        allow_stale: bool,
        versions: WeightVersions | None = None,
        lengths: LengthModel | None = None,
    ) -> None:
        self.engine = engine
        self.snap: SnapshotEngine | None = None
        if isinstance(engine, SnapshotEngine) and engine.snapshots_enabled:
            self.snap = engine
        self.counters = counters
        self.admission = admission
        self.allow_stale = allow_stale
        self.running: dict[str, Running] = {}  # sample_id -> its engine request
        self.load: dict[Slot, list[float]] = {}  # slot -> [running samples, KV need]
        # The weight version new segments run under, and the versions seen.
        self.versions = versions if versions is not None else WeightVersions(engine)
        self._capacity_key: object = ()  # what the admission bound was sized for
        self.updated = asyncio.Event()  # clear while a weight update holds cut segments
        self.updated.set()
        self._resend_cuts: asyncio.Future[None] | None = None
        # Predicted lengths: written on each member as its group starts, scored as it ends.
        self.lengths = lengths if lengths is not None else LengthModel()

    @property
    def snapshots_enabled(self) -> bool:
        return self.snap is not None

    def usable(
        self, sample: Sample, current: str, history: Sequence[str], max_staleness: int | None
    ) -> bool:
        return self.snap is not None and K.usable(
            sample, current, history, max_staleness, self.allow_stale
        )

    def loads(self) -> list[SlotLoad]:
        out = []
        for slot in self.engine.slots():
            running, kv = self.load.get(slot, (0, 0.0))
            out.append(SlotLoad(slot, int(running), kv, self.engine.healthy(slot)))
        return out

    def _add_load(self, slot: Slot, samples: int, kv: float) -> None:
        acc = self.load.setdefault(slot, [0, 0.0])
        acc[0] += samples
        # KV needs are floats taken back in another order than added: an idle slot would
        # keep a residue (~1e-14) that tips placement's ties. Nothing running needs nothing.
        acc[1] = acc[1] + kv if acc[0] else 0.0

    # ---- start ---------------------------------------------------------------------------

    async def admission_ready(self) -> Admission:
        """The admission bound, sized from what the engine can run: once for one server, again
        whenever an owner's pool of healthy engines changes (#23: it follows the pool)."""
        key = self.engine.capacity_key()
        if key != self._capacity_key:
            capacity = await self.engine.capacity()
            if capacity is not None:
                self.admission.configure(capacity)
                self._capacity_key = key
        return self.admission

    def start_group(
        self,
        group: Group,
        owner: str,
        tally: CallTally,
        max_staleness: int | None,
        tasks: dict[asyncio.Task[None], str],
    ) -> int:
        """Start every unfinished member of held `group` (one out of budget is marked
        truncated instead); their tasks go into `tasks`. Returns how many started."""
        n = 0
        self.lengths.mark(group)
        for s in group.samples:
            if S.is_finished(s) or T.awaiting(s):  # an awaiting member runs once answered
                continue
            if s.sample_id in self.running:  # answered before its group started: it runs
                continue
            if S.remaining_budget(s) <= 0:
                s.status, s.finish_reason = "truncated", "length"
                continue
            tasks[self.start(s, owner, tally, max_staleness)] = group.group_id
            n += 1
        return n

    def start(
        self,
        sample: Sample,
        owner: str,
        tally: CallTally,
        max_staleness: int | None = None,
        override_params: dict[str, Any] | None = None,
        kv_mode: KvMode = "auto",
    ) -> asyncio.Task[None]:
        """Start the next segment of `sample` under the version now; the task records it."""
        version, history = self.versions.now(), self.versions.history
        if sample.sample_id in self.running:
            raise conflict("sample_running", f"sample {sample.sample_id!r} is generating")
        usable = self.usable(sample, version, history, max_staleness)
        # Where its snapshot lives, read before planning: a staleness restart clears the
        # sample's figures, and the snapshot it makes useless must still be freed.
        held = K.held_at(sample) if self.snap is not None else None
        cont = S.plan_continuation(
            sample, version, max_staleness, history, override_params, owner == BACKGROUND
        )
        if cont.restarted:
            self.count_restart(sample, tally)
        restore = cont.kv == "recomputed" and K.wants_restore(kv_mode, usable, cont.restarted)
        need = kv_need(len(cont.input_ids), int(cont.sampling_params["max_new_tokens"]))
        if restore:
            cont = replace(cont, cache_ns=K.cache_namespace(sample, version))
        call = self._plan(sample, owner, cont, restore, held)  # None: nothing healthy now
        # The task starts at the next loop turn, once its `Running` entry is in place.
        task = asyncio.get_running_loop().create_task(
            self._run(sample.sample_id, cont, restore, call, need)
        )
        # Never planned (nothing healthy now): the runner must still free a snapshot that a
        # staleness restart made useless (the restart cleared where it lives). One still
        # usable stays, with the sample's figures pointing at it.
        drop_if_unplanned = held if call is None and cont.restarted else None
        run = Running(sample, owner, "", task, unplanned_drop=drop_if_unplanned)
        run.max_staleness, run.override_params, run.tally = max_staleness, override_params, tally
        run.planned_version = version
        if call is not None:
            run.rid, run.slot, run.restore_planned = call.rid, call.slot, call.restore
            self._add_load(call.slot, 1, need)
        self.running[sample.sample_id] = run
        self.admission.take(1, need)
        task.add_done_callback(lambda _: self.admission.give_back(1, need))
        return task

    def count_restart(self, sample: Sample, tally: CallTally) -> None:
        """A staleness restart (`S.restart_for_staleness` counts it on the sample): the
        server's figure and a note for the call whose figures it counts in."""
        self.counters.staleness_restarts += 1
        tally.notes.append(f"{sample.sample_id}: restarted from its prompt (max_staleness)")

    def _plan(
        self, sample: Sample, owner: str, cont: S.Continuation, restore: bool, held: Slot | None
    ) -> SegmentCall | None:
        """Where the segment runs and what the engine does first (None: nowhere healthy).
        `held`: where the sample's snapshot lives (None: it has none)."""
        long = None
        if self.lengths.placement == "tail":
            long = is_long(sample.predicted_remaining, self.lengths.prior)
        try:
            plan = plan_segment(self.loads(), held, restore, long)
        except NoHealthySlot:
            return None
        if plan.drop is not None:
            K.clear(sample)  # the engine frees it before the segment runs
        rid = f"{sample.sample_id}@{owner}.{len(sample.segments)}.{uuid.uuid4().hex[:6]}"
        return SegmentCall(
            rid,
            sample.sample_id,
            cont.input_ids,
            cont.sampling_params,
            plan.slot,
            plan.restore,
            plan.drop,
            cont.cache_ns if plan.restore else None,
            0 if sample.return_routed_experts else None,  # a restore moves it (base.py)
        )

    async def _replan(
        self, run: Running, cont: S.Continuation, restore: bool
    ) -> SegmentCall | None:
        """Plan again once a healthy slot exists; None when the run is being stopped, or
        nothing became healthy within ENGINE_WAIT_S."""
        deadline = time.monotonic() + ENGINE_WAIT_S
        while not run.stopping and time.monotonic() < deadline:
            held = run.unplanned_drop or (K.held_at(run.sample) if self.snap else None)
            call = self._plan(run.sample, run.owner, cont, restore, held)
            if call is not None:
                run.unplanned_drop = None
                return call
            await asyncio.sleep(HEALTH_POLL_S)
        return None

    # ---- end -----------------------------------------------------------------------------

    async def _run(
        self,
        sample_id: str,
        cont: S.Continuation,
        restore: bool,
        call: SegmentCall | None,
        need: float,
    ) -> None:
        run = self.running[sample_id]
        try:
            ended = await self._segments_until_ended(run, cont, restore, call, need)
        except Exception:  # a bug, or an engine's malformed answer: as an engine error would
            logger.exception("april: a segment of %s failed; it keeps what it had", sample_id)
            ended = None
        finally:
            # Whatever happened, the sample is no longer running: left in `running`, every
            # later start would refuse it (409 sample_running) for the server's life.
            self.running.pop(sample_id, None)
        if ended is None:
            return
        await self._ended(run, ended)

    async def _segments_until_ended(
        self,
        run: Running,
        cont: S.Continuation,
        restore: bool,
        call: SegmentCall | None,
        need: float,
    ) -> tuple[SegmentOutcome, S.Continuation] | None:
        """Segments of `run` until one ends other than by a weight update's cut; None when
        the last one was recorded already (the cut landed on its last token)."""
        sample = run.sample
        ended: SegmentOutcome | None = None  # None: ended by a cut, recorded already
        while True:
            try:
                outcome = await self._one_segment(run, cont, restore, call, need)
            except _PlannedBeforeUpdate as moved:
                cont, call, restore = self._plan_after_update(run, need, moved.call)
                continue
            out = self._classified(sample, cont, outcome)
            ended = out
            cut = run.cut and out.result.finish_reason == "abort" and out.result.error is None
            run.cut = False
            if not cut:
                break
            # A weight update cut this segment at the version boundary: what the old weights
            # made is kept as its own segment, and the sample goes on under the new weights
            # (unless it is being stopped meanwhile: then it ends like any interrupted one).
            # Until its continuation is planned it is judged by no one yet: nobody may take
            # it over meanwhile (`Background.hand_over`), or it would be judged by the taker's
            # rule instead of the one it was cut under.
            run.resuming = True
            try:
                await self._until_updated(run)
                if run.stopping:
                    break
                self._record(sample, out, cont, run.tally)
                await self._settle(sample, out, True, False, False, run.restore_planned)
                if S.is_finished(sample) or T.awaiting(sample):  # the cut hit its last token
                    ended = None
                    break
                cont, call, restore = self._continue_after_cut(run, need)
            finally:
                run.resuming = False
        if run.unplanned_drop is not None and self.snap is not None:
            # Never planned (stopped, or nothing healthy): free the restart's useless snapshot.
            try:
                await self.snap.drop_snapshot(sample.sample_id, run.unplanned_drop)
            except Exception as exc:  # its engine is gone, and the snapshot with it
                logger.warning("april: could not free %s's snapshot: %s", sample.sample_id, exc)
        return None if ended is None else (ended, cont)

    async def _ended(self, run: Running, ended: tuple[SegmentOutcome, S.Continuation]) -> None:
        """Record how the last segment ended, as `keep` asked, once `run` left `running`."""
        sample = run.sample
        out, cont = ended
        keep, marked = run.keep, run.marked
        natural = out.result.finish_reason in ("stop", "length")
        if keep == "drop" and not natural:
            S.reset_output(sample)
            await self._settle(sample, out, False, False, marked, run.restore_planned)
            return
        self._record(sample, out, cont, run.tally)
        # "Interrupted" means still unfinished: an abort that lands on the last budgeted
        # token ends a finished sample, whose snapshot would never be used.
        if out.result.error is None:  # after an engine error, what was held stays as it was
            partial = sample.status == "partial"
            tried = run.restore_planned
            await self._settle(sample, out, partial, keep == "snapshot", marked, tried)

    async def _one_segment(
        self,
        run: Running,
        cont: S.Continuation,
        restore: bool,
        call: SegmentCall | None,
        need: float,
    ) -> SegmentOutcome:
        """Run one planned segment to its end; a segment whose engine went away runs again
        on a healthy one. Engine failures come back as an outcome that keeps nothing."""
        sample = run.sample
        while True:
            if call is None:  # the first plan found nothing healthy, or its engine died
                call = await self._replan(run, cont, restore)
                if call is None:
                    why = "stopped" if run.stopping else f"no healthy engine in {ENGINE_WAIT_S} s"
                    return self._failed(sample, run.slot, f"engine unavailable ({why})", run.tally)
                run.rid, run.slot, run.restore_planned = call.rid, call.slot, call.restore
                self._add_load(call.slot, 1, need)
            if not self.updated.is_set():
                held = await self._held_for_update(run, call)
                if held is not None:
                    return held
                if self.versions.now() != run.planned_version:
                    self._add_load(call.slot, -1, -need)
                    raise _PlannedBeforeUpdate(call)
            try:
                return await self.engine.run_segment(call)
            except EngineUnavailable as exc:
                # What it generated there is lost with the engine; the sample keeps what it
                # had and, unless it is being stopped, its segment runs again elsewhere.
                self.counters.engine_failovers += 1
                run.tally.notes.append(f"{sample.sample_id}: {exc}; its segment runs again")
                await self._drop_unexecuted(call)
                call = None
            except Exception as exc:  # an engine failure must not lose the sample
                logger.exception("engine error on %s", call.rid)
                await self._drop_unexecuted(call)
                return self._failed(sample, call.slot, f"engine error: {exc}", run.tally)
            finally:
                self._add_load(run.slot, -1, -need)

    async def _held_for_update(self, run: Running, call: SegmentCall) -> SegmentOutcome | None:
        """A segment about to start while a weight update holds the running ones (a push, or
        a whole begin..end session) waits for its end, as they do: SGLang releases its lock
        between a session's messages, so it would otherwise generate on half-loaded weights.
        Stopped meanwhile: it ends having generated nothing (None: it may run now)."""
        await self._until_updated(run)
        if not run.stopping:
            return None
        await self._drop_unexecuted(call)  # never reached an engine
        result = SegmentResult([], [], "abort", self.versions.now())
        return SegmentOutcome(result, call.slot)

    def _plan_after_update(
        self, run: Running, need: float, old: SegmentCall
    ) -> tuple[S.Continuation, SegmentCall | None, bool]:
        """A segment planned under the weights before an update and held until its end, not
        started: planned again under the new version, as a segment the update cut is, so
        its owner's `max_staleness` judges it now (it would otherwise extend a prefix the
        rule no longer allows). A snapshot the old plan was to restore (under the old
        weights) or to free is freed by the new plan's engine call."""
        held = old.slot if old.restore else old.drop
        if old.restore:
            run.restore_planned = False
            K.clear(run.sample)
        return self._continue_after_cut(run, need, held)

    async def _drop_unexecuted(self, call: SegmentCall) -> None:
        """The plan gave up the sample's old snapshot (`_plan` cleared its figures) and left
        freeing it to the engine at the segment's start, but the segment failed, maybe before
        it got there: free it now (a no-op where it was freed). Otherwise nobody knows of it."""
        if call.drop is None or self.snap is None:
            return
        try:
            await self.snap.drop_snapshot(call.key, call.drop)
        except Exception as exc:  # its engine is gone, and the snapshot with it
            logger.warning("april: could not free %s's snapshot: %s", call.key, exc)

    def _classified(
        self, sample: Sample, cont: S.Continuation, out: SegmentOutcome
    ) -> SegmentOutcome:
        """A segment that ended by abort in the step that completed a stop ended by that stop
        (`stops.py`): a turn stop makes its member await input, EOS finishes it."""
        r = out.result
        if r.finish_reason != "abort" or r.error is not None or not r.output_ids:
            return out
        new = r.output_ids[: S.remaining_budget(sample)]
        before = sample.output_ids[T.turn_start(sample) :]
        params = cont.sampling_params
        stop = reached_stop(params, before, new, self.engine.eos_token_ids, self.engine.detokenize)
        if stop is None:
            return out
        self.counters.stops_behind_aborts += 1
        result = replace(r, output_ids=new, finish_reason="stop", matched=stop)
        return replace(out, result=result)

    def _record(
        self, sample: Sample, out: SegmentOutcome, cont: S.Continuation, tally: CallTally
    ) -> None:
        """Record the segment's tokens on the sample and count them."""
        before = len(sample.output_ids)
        kv = "restored" if out.restored > 0 else cont.kv
        S.apply_segment(sample, out.result, kv, out.slot.engine, out.slot.dp_rank)
        T.end_of_segment(sample, out.result.matched)  # a turn stop: it awaits input
        if S.is_finished(sample):
            self.lengths.finished(sample)
        produced = len(sample.output_ids) - before
        tally.output_tokens += produced
        self.counters.output_tokens += produced
        if cont.kv == "recomputed":
            # Prefill work a full restore would have avoided (the newest token is always run).
            redo = max(0, len(cont.input_ids) - 1 - out.result.cached_tokens)
            tally.resumed_samples += 1
            tally.recomputed_tokens += redo
            tally.restored_kv_tokens += out.restored
            self.counters.resumed_samples += 1
            self.counters.recomputed_tokens += redo
            self.counters.restored_kv_tokens += out.restored

    def _failed(self, sample: Sample, slot: Slot, why: str, tally: CallTally) -> SegmentOutcome:
        """The segment produced nothing we can keep: the sample stays as it was."""
        self.counters.engine_errors += 1
        tally.notes.append(f"{sample.sample_id}: {why}")
        version = self.engine.weight_version()
        return SegmentOutcome(S.SegmentResult([], [], None, version, error=why), slot)

    async def _settle(
        self,
        sample: Sample,
        out: SegmentOutcome,
        interrupted: bool,
        wanted: bool,
        marked: bool,
        tried_restore: bool,
    ) -> None:
        # A restore that made nothing visible (evicted pages, no free slots, a late answer)
        # still leaves the snapshot in the store: it counts as restored here, or it leaks.
        restored = out.restored > 0 or tried_restore
        verdict = K.after_segment(out.snapshot_bytes, interrupted, wanted, marked, restored)
        if verdict == "keep" and out.snapshot_bytes:
            K.record(sample, out.snapshot_bytes, out.slot, restored=out.restored > 0)
            return
        if verdict == "drop" and self.snap is not None:
            await self.snap.drop_snapshot(sample.sample_id, out.slot)
        K.clear(sample)

    # ---- weight updates: cut at the version boundary, continue after -------------------

    async def before_update(self) -> None:
        """A weight update is about to run: end every running segment at the version boundary
        (abort; SGLang's update waits for them to leave), to continue after `after_update`
        under the new weights. The weight push then waits for one decode step, not for the
        longest straggler."""
        self.updated.clear()
        cut = [r for r in self.running.values() if not r.stopping and not r.task.done()]
        for r in cut:
            r.cut = True
            self.engine.abort(r.rid)
        # A segment started a moment ago may not be registered yet, so SGLang dropped its
        # abort and the update would wait for all of it: re-send until each cut has landed.
        self._resend_cuts = asyncio.ensure_future(self._resend_cut_aborts(cut))

    async def _resend_cut_aborts(self, cut: list[Running]) -> None:
        for wait_s in (*ABORT_RESEND_S, *[ABORT_POLL_S] * int(ENGINE_WAIT_S / ABORT_POLL_S)):
            await asyncio.sleep(wait_s)
            cut = [r for r in cut if r.cut and not r.task.done()]  # `_run` clears it on landing
            if not cut or self.updated.is_set():
                return
            for r in cut:
                self.engine.abort(r.rid)

    def after_update(self) -> None:
        # Record the version now, even if nothing runs: staleness counts versions by their
        # place in the history, and two pushes nobody generated between would count as one.
        self.versions.now()
        self.updated.set()
        if self._resend_cuts is not None:
            self._resend_cuts.cancel()
            self._resend_cuts = None

    async def _until_updated(self, run: Running) -> None:
        if self.updated.is_set():
            return
        waits = [asyncio.ensure_future(e.wait()) for e in (self.updated, run.stop_requested)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _continue_after_cut(
        self, run: Running, need: float, held: Slot | None = None
    ) -> tuple[S.Continuation, SegmentCall | None, bool]:
        """The next segment of a sample cut by a weight update, under the version now.
        `held`: where a snapshot lives that the new plan must free (None: none)."""
        sample = run.sample
        version = self.versions.now()
        cont = S.plan_continuation(
            sample,
            version,
            run.max_staleness,
            self.versions.history,
            run.override_params,
            run.owner == BACKGROUND,
        )
        if cont.restarted:
            self.count_restart(sample, run.tally)
        call = self._plan(sample, run.owner, cont, False, held)
        run.planned_version = version
        if call is not None:
            run.rid, run.slot, run.restore_planned = call.rid, call.slot, call.restore
            self._add_load(call.slot, 1, need)
        elif held is not None:
            run.unplanned_drop = held
        return cont, call, False

    # ---- stop, forget --------------------------------------------------------------------

    async def stop(self, runs: list[Running], keep: Keep | None = None) -> None:
        """Abort `runs` and return only when none of them is generating any more."""
        if keep is not None:
            for r in runs:
                r.keep = keep
        for r in runs:
            r.stopping = True
            r.stop_requested.set()
            if (
                r.keep == "snapshot"
                and not r.task.done()
                and not r.marked
                and self.snap is not None
            ):
                # Addressed to the request's slot, ordered before the abort below.
                self.snap.mark_snapshot(r.rid, r.sample.sample_id, r.slot)
                r.marked = True
        pending = {r.task for r in runs if not r.task.done()}
        waits = iter(ABORT_RESEND_S)
        while pending:
            for r in runs:
                if not r.task.done():
                    self.engine.abort(r.rid)  # idempotent: SGLang sends one abort per request
            _, pending = await asyncio.wait(pending, timeout=next(waits, ABORT_POLL_S))

    async def forget(self, sample: Sample) -> None:
        """Free the sample's snapshot, wherever it lives."""
        slot = K.held_at(sample)
        K.clear(sample)
        await self.drop(sample.sample_id, slot)

    async def drop(self, sample_id: str, slot: Slot | None) -> None:
        """Free a snapshot the sample's figures no longer point at (held on `slot`)."""
        if slot is not None and self.snap is not None:
            await self.snap.drop_snapshot(sample_id, slot)

    async def refresh(self, samples: Sequence[Sample]) -> None:
        """Clear the figures of snapshots the store has evicted since."""
        if self.snap is None:
            return
        for s in samples:
            slot = K.held_at(s)
            if slot is not None and await self.snap.snapshot_info(s.sample_id, slot) is None:
                K.clear(s)

    def by_slot(self) -> list[dict[str, Any]]:
        """What this server runs where, for /stats."""
        return [
            {
                "engine": x.slot.engine,
                "dp_rank": x.slot.dp_rank,
                "running_samples": x.running,
                "kv_need_tokens": int(x.kv_tokens),
                "healthy": x.healthy,
            }
            for x in self.loads()
        ]
