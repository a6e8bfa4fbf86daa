"""Running segments: plan (pure), hand the plan to the engine (one call), record (pure).

A segment is one engine request of a sample: prompt + output so far as input, the remaining
budget. Starting one decides, without I/O, what it runs as (`samples.plan_continuation`),
whether its KV snapshot may be reused (`snapshots.usable`) and where it runs
(`placement.plan_segment`: the snapshot's slot, else the least loaded one); the engine then
performs the whole plan in one `run_segment` call (free an unused snapshot, restore, generate
pinned to the slot, release). Its end is recorded by `samples.apply_segment`, and
`snapshots.after_segment` says whether the snapshot the engine holds is kept or freed.

The runner is handed two parts (the composition root builds them): `planner`
(`SegmentPlanner`, segment_planner.py: the load, the admission bound, a segment's plan) and
`weight_cut` (`WeightCut`, weight_cut.py: what a weight push does to running segments); this
file starts, runs, records and stops segments.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from april_client.protocol import Group, Keep, KvMode, Sample
from april_server.engine.base import BaseEngine, EngineUnavailable, SegmentCall, SegmentOutcome
from april_server.engine.segment_planner import SegmentPlanner
from april_server.engine.segment_state import BACKGROUND, CallTally, Counters, Running
from april_server.engine.snapshot_places import SnapshotPlaces
from april_server.engine.versions import WeightVersions
from april_server.engine.weight_cut import (
    ABORT_POLL_S,
    ABORT_RESEND_S,
    ENGINE_WAIT_S,
    PlannedBeforeUpdate,
    WeightCut,
)
from april_server.rules import samples as sample_rules
from april_server.rules import snapshots as snapshot_rules
from april_server.rules import turns as turn_rules
from april_server.rules.inflight import Admission, kv_need
from april_server.rules.lengths import LengthModel
from april_server.rules.placement import Slot
from april_server.rules.stops import reached_stop
from april_server.wire.errors import conflict

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5  # how often a segment waiting for a healthy engine plans again


class SegmentRunner:
    """Starts, runs, records and stops segments; where they run is its planner's plan, and
    what a weight push does to them is its weight cut's."""

    def __init__(
        self,
        engine: BaseEngine,
        counters: Counters,
        admission: Admission,
        versions: WeightVersions,
        lengths: LengthModel,
        running: dict[str, Running],
        planner: SegmentPlanner,
        weight_cut: WeightCut,
        places: SnapshotPlaces,
    ) -> None:
        """`running`: sample id -> its engine request, shared with `weight_cut` (which cuts
        them) and read by the rest of the server; `lengths`: predictions written on each
        member as its group starts, scored as it ends."""
        self.engine = engine
        self.counters = counters
        self.admission = admission
        self.versions = versions  # the weight version new segments run under, and those seen
        self.lengths = lengths
        self.running = running
        self.planner = planner
        self.snap = planner.snap  # None: this engine keeps no KV snapshots
        self.weight_cut = weight_cut
        self.places = places  # where each sample's snapshot lives

    # ---- who runs what ---------------------------------------------------------------------

    def is_running(self, sample_id: str) -> bool:
        return sample_id in self.running

    def runs_of(self, owner: str) -> list[Running]:
        return [r for r in self.running.values() if r.owner == owner]

    def runs_in(self, group_id: str) -> list[Running]:
        return [r for r in self.running.values() if r.sample.group_id == group_id]

    def pass_runs(self, runs: list[Running], owner: str) -> None:
        """These runs keep generating, for `owner` now (their group passed to it)."""
        for r in runs:
            r.owner = owner

    def judge_runs(self, runs: list[Running], tally: CallTally, max_staleness: int | None) -> None:
        """From now on these runs are planned under `max_staleness` and counted in `tally`."""
        for r in runs:
            r.max_staleness, r.tally = max_staleness, tally

    # ---- start ---------------------------------------------------------------------------

    def start_group(
        self, group: Group, owner: str, tally: CallTally, max_staleness: int | None
    ) -> list[asyncio.Task[None]]:
        """Start every unfinished member of held `group` (one out of budget is marked
        truncated instead); returns their tasks."""
        started = []
        self.lengths.mark(group)
        for s in group.samples:
            if sample_rules.is_finished(s) or turn_rules.awaiting(
                s
            ):  # an awaiting member runs once answered
                continue
            if s.sample_id in self.running:  # answered before its group started: it runs
                continue
            if sample_rules.remaining_budget(s) <= 0:
                s.status, s.finish_reason = "truncated", "length"
                continue
            started.append(self.start(s, owner, tally, max_staleness))
        return started

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
        usable = self.planner.usable(sample, version, history, max_staleness)
        # Where its snapshot lives, read before planning: a staleness restart clears the
        # sample's figures, and the snapshot it makes useless must still be freed.
        held = self.places.of(sample) if self.snap is not None else None
        cont = sample_rules.plan_continuation(
            sample, version, max_staleness, history, override_params, owner == BACKGROUND
        )
        if cont.restarted:
            self.planner.count_restart(sample, tally)
        restore = cont.kv == "recomputed" and snapshot_rules.wants_restore(
            kv_mode, usable, cont.restarted
        )
        need = kv_need(len(cont.input_ids), int(cont.sampling_params["max_new_tokens"]))
        if restore:
            cont = replace(cont, cache_ns=snapshot_rules.cache_namespace(sample, version))
        call = self.planner.plan(sample, owner, cont, restore, held)  # None: nothing healthy now
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
        run.placing = call is None
        if call is not None:
            run.rid, run.slot, run.restore_planned = call.rid, call.slot, call.restore
            self.planner.add_load(call.slot, 1, need)
        self.running[sample.sample_id] = run
        self.admission.take(1, need)
        task.add_done_callback(lambda _: self.admission.give_back(1, need))
        return task

    async def _replan(
        self, run: Running, cont: sample_rules.Continuation, restore: bool
    ) -> SegmentCall | None:
        """Plan again once a healthy slot exists; None when the run is being stopped, or
        nothing became healthy within ENGINE_WAIT_S."""
        deadline = time.monotonic() + ENGINE_WAIT_S
        run.placing = True
        try:
            while not run.stopping and time.monotonic() < deadline:
                held = run.unplanned_drop or (self.places.of(run.sample) if self.snap else None)
                call = self.planner.plan(run.sample, run.owner, cont, restore, held)
                if call is not None:
                    run.unplanned_drop = None
                    return call
                await asyncio.sleep(HEALTH_POLL_S)
            return None
        finally:
            run.placing = False

    # ---- end -----------------------------------------------------------------------------

    async def _run(
        self,
        sample_id: str,
        cont: sample_rules.Continuation,
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
        cont: sample_rules.Continuation,
        restore: bool,
        call: SegmentCall | None,
        need: float,
    ) -> tuple[SegmentOutcome, sample_rules.Continuation] | None:
        """Segments of `run` until one ends other than by a weight update's cut; None when
        the last one was recorded already (the cut landed on its last token)."""
        sample = run.sample
        ended: SegmentOutcome | None = None  # None: ended by a cut, recorded already
        while True:
            try:
                outcome = await self._one_segment(run, cont, restore, call, need)
            except PlannedBeforeUpdate as moved:
                cont, call, restore = self.weight_cut.plan_after_update(run, need, moved.call)
                continue
            out = self._classified(sample, cont, outcome)
            ended = out
            cut = run.cut and out.result.finish_reason == "abort" and out.result.error is None
            run.cut = False
            if not cut:
                break
            self.weight_cut.note_cut(sample, out.result)
            # A weight update cut this segment at the version boundary: what the old weights
            # made is kept as its own segment, and the sample goes on under the new weights
            # (unless it is being stopped meanwhile: then it ends like any interrupted one).
            # Until its continuation is planned it is judged by no one yet: nobody may take
            # it over meanwhile (`Background.hand_over`), or it would be judged by the taker's
            # rule instead of the one it was cut under.
            run.resuming = True
            try:
                await self.weight_cut.until_updated(run)
                if run.stopping:
                    break
                self._record(sample, out, cont, run.tally)
                await self._settle(sample, out, True, False, False, run.restore_planned)
                # The cut hit its last token.
                if sample_rules.is_finished(sample) or turn_rules.awaiting(sample):
                    ended = None
                    break
                cont, call, restore = self.weight_cut.continue_after_cut(run, need)
            finally:
                run.resuming = False
        if run.unplanned_drop is not None and self.snap is not None:
            # Never planned (stopped, or nothing healthy): free the restart's useless snapshot.
            try:
                await self.snap.drop_snapshot(sample.sample_id, run.unplanned_drop)
            except Exception as exc:  # its engine is gone, and the snapshot with it
                logger.warning("april: could not free %s's snapshot: %s", sample.sample_id, exc)
        return None if ended is None else (ended, cont)

    async def _ended(
        self, run: Running, ended: tuple[SegmentOutcome, sample_rules.Continuation]
    ) -> None:
        """Record how the last segment ended, as `keep` asked, once `run` left `running`."""
        sample = run.sample
        out, cont = ended
        keep, marked = run.keep, run.marked
        natural = out.result.finish_reason in ("stop", "length")
        if keep == "drop" and not natural:
            sample_rules.reset_output(sample)
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
        cont: sample_rules.Continuation,
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
                self.planner.add_load(call.slot, 1, need)
            if not self.weight_cut.updated.is_set():
                held = await self.weight_cut.held_for_update(run, call)
                if held is not None:
                    return held
            # Planned under weights an update has replaced since (held by it above, or planned
            # again after its engine went away, with the continuation planned before): judged
            # again under the version now, or its owner's max_staleness would be skipped.
            if self.versions.now() != run.planned_version:
                self.planner.add_load(call.slot, -1, -need)
                raise PlannedBeforeUpdate(call)
            try:
                return await self.engine.run_segment(call)
            except EngineUnavailable as exc:
                # What it generated there is lost with the engine; the sample keeps what it
                # had and, unless it is being stopped, its segment runs again elsewhere.
                self.counters.engine_failovers += 1
                run.tally.notes.append(f"{sample.sample_id}: {exc}; its segment runs again")
                await self.planner.drop_unexecuted(call)
                call = None
            except Exception as exc:  # an engine failure must not lose the sample
                logger.exception("engine error on %s", call.rid)
                await self.planner.drop_unexecuted(call)
                return self._failed(sample, call.slot, f"engine error: {exc}", run.tally)
            finally:
                self.planner.add_load(run.slot, -1, -need)

    def _classified(
        self, sample: Sample, cont: sample_rules.Continuation, out: SegmentOutcome
    ) -> SegmentOutcome:
        """A segment that ended by abort in the step that completed a stop ended by that stop
        (`stops.py`): a turn stop makes its member await input, EOS finishes it."""
        r = out.result
        if r.finish_reason != "abort" or r.error is not None or not r.output_ids:
            return out
        new = r.output_ids[: sample_rules.remaining_budget(sample)]
        before = sample.output_ids[turn_rules.turn_start(sample) :]
        params = cont.sampling_params
        stop = reached_stop(params, before, new, self.engine.eos_token_ids, self.engine.detokenize)
        if stop is None:
            return out
        self.counters.stops_behind_aborts += 1
        result = replace(r, output_ids=new, finish_reason="stop", matched=stop)
        return replace(out, result=result)

    def _record(
        self, sample: Sample, out: SegmentOutcome, cont: sample_rules.Continuation, tally: CallTally
    ) -> None:
        """Record the segment's tokens on the sample and count them."""
        before = len(sample.output_ids)
        kv = "restored" if out.restored > 0 else cont.kv
        sample_rules.apply_segment(sample, out.result, kv, out.slot.engine, out.slot.dp_rank)
        turn_rules.end_of_segment(sample, out.result.matched)  # a turn stop: it awaits input
        if sample_rules.is_finished(sample):
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
        return SegmentOutcome(sample_rules.SegmentResult([], [], None, version, error=why), slot)

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
        verdict = snapshot_rules.after_segment(
            out.snapshot_bytes, interrupted, wanted, marked, restored
        )
        if verdict == "keep" and out.snapshot_bytes:
            self.places.record(sample, out.snapshot_bytes, out.slot, restored=out.restored > 0)
            return
        if verdict == "drop" and self.snap is not None:
            await self.snap.drop_snapshot(sample.sample_id, out.slot)
        self.places.clear(sample)

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
        slot = self.places.of(sample)
        self.places.clear(sample)
        await self.drop(sample.sample_id, slot)

    async def drop(self, sample_id: str, slot: Slot | None) -> None:
        """Free a snapshot the sample's figures no longer point at (held on `slot`)."""
        self.places.forget(sample_id, slot)
        if slot is not None and self.snap is not None:
            await self.snap.drop_snapshot(sample_id, slot)

    async def refresh(self, samples: Sequence[Sample]) -> None:
        """Clear the figures of snapshots the store has evicted since. One listing of what
        every slot holds, not one question per sample: a page of the buffer holds hundreds,
        and each question is a round trip to a scheduler busy generating. A slot the listing
        does not cover (an engine that cannot list, one out of the pool) is asked per sample."""
        if self.snap is None:
            return
        places = self.places
        held = []
        for s in samples:
            slot, stamp = places.stamp(s)
            if slot is not None:
                held.append((s, slot, stamp))
        listed = await self.snap.snapshot_keys() if len(held) > 1 else {}
        for s, slot, stamp in held:
            keys = listed.get(slot)
            if keys is not None:
                evicted = s.sample_id not in keys
            else:
                evicted = await self.snap.snapshot_info(s.sample_id, slot) is None
            # Only if its snapshot is still the one asked about: the listing awaited the engines,
            # and meanwhile a segment may have freed it and left another, on that slot or
            # another (a body read from the store may even have asked about a place the live
            # sample no longer has); cleared then, the new one would be held with nothing
            # pointing at it.
            if evicted and places.stamp(s) == (slot, stamp):
                places.clear(s)
