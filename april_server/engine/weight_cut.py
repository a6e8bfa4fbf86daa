"""What a weight push does to running segments: cut at the version boundary, held, replanned.

`before_update` aborts every running segment (SGLang's update waits for them to leave, so the
push waits for one decode step, not for the longest straggler); what the old weights made is
kept as its own segment, and `after_update` lets each go on as a new segment planned under the
new version (`continue_after_cut`). A segment about to start while an update runs is held
until its end (`held_for_update`), and one planned under the old weights is planned again
(`plan_after_update`). The runner's loop (`segment_runner.py`) calls these; a weight update's
hooks call `before_update`/`after_update` (the process registers this part as their listener:
`cli.py`, and the owner's `fleet/gateway.py`). Each cut sample is also recorded in the
server's length census (`rules/goodput.py`) as at least as long as it got.
"""

from __future__ import annotations

import asyncio

from april_client.protocol import Sample
from april_server.engine.base import BaseEngine, SegmentCall, SegmentOutcome
from april_server.engine.segment_planner import SegmentPlanner
from april_server.engine.segment_state import BACKGROUND, Running
from april_server.engine.snapshot_places import SnapshotPlaces
from april_server.engine.versions import WeightVersions
from april_server.rules import samples as sample_rules
from april_server.rules.goodput import LengthCensus
from april_server.rules.placement import Slot
from april_server.rules.samples import SegmentResult

ABORT_POLL_S = 0.2  # how often an abort is re-sent while its request is still generating
# SGLang drops an abort for a request it has not registered yet (`abort_request` ignores an
# unknown rid), and a segment started a moment ago (e.g. one a weight update just continued)
# is often not registered yet when a call pauses the background: the first re-sends come
# soon, so a stop waits a few milliseconds for such a request rather than a whole poll.
ABORT_RESEND_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)
# How long a segment whose engine went away waits for a healthy one (`segment_runner.py`), and
# how long a cut's abort is re-sent.
ENGINE_WAIT_S = 30.0


class PlannedBeforeUpdate(Exception):
    """A segment held by a weight update before it started, planned under the old weights."""

    def __init__(self, call: SegmentCall) -> None:
        super().__init__(call.rid)
        self.call = call


class WeightCut:
    def __init__(
        self,
        engine: BaseEngine,
        running: dict[str, Running],
        versions: WeightVersions,
        planner: SegmentPlanner,
        places: SnapshotPlaces,
        census: LengthCensus | None = None,
    ) -> None:
        """`census`: the lengths the pool's sizing plays from (None: none kept): a cut sample is
        recorded in it as at least as long as it got."""
        self.engine = engine
        self.running = running  # the segment runner's: sample id -> its engine request
        self.versions = versions
        self.planner = planner  # plans a cut segment's continuation
        self.places = places  # where each sample's snapshot lives
        self.updated = asyncio.Event()  # clear while a weight update holds cut segments
        self.updated.set()
        self._resend_cuts: asyncio.Future[None] | None = None
        self.census = census

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
            cut = [r for r in cut if r.cut and not r.task.done()]  # the runner clears it on landing
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

    async def until_updated(self, run: Running) -> None:
        if self.updated.is_set():
            return
        waits = [asyncio.ensure_future(e.wait()) for e in (self.updated, run.stop_requested)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def held_for_update(self, run: Running, call: SegmentCall) -> SegmentOutcome | None:
        """A segment about to start while a weight update holds the running ones (a push, or
        a whole begin..end session) waits for its end, as they do: SGLang releases its lock
        between a session's messages, so it would otherwise generate on half-loaded weights.
        Stopped meanwhile: it ends having generated nothing (None: it may run now)."""
        await self.until_updated(run)
        if not run.stopping:
            return None
        await self.planner.drop_unexecuted(call)  # never reached an engine
        result = SegmentResult([], [], "abort", self.versions.now())
        return SegmentOutcome(result, call.slot)

    def note_cut(self, sample: Sample, result: SegmentResult) -> None:
        """A segment a push cut has landed (not recorded on `sample` yet): the sample is at
        least as long as it got. The samples still running when a call ends are recorded there
        without the segment they are in the middle of, so without the cuts the fit would know
        the long ones only once they finished, and play the tail as shorter than it is."""
        if self.census is not None:
            made = len(sample.output_ids) + len(result.output_ids)
            self.census.record_sample(sample, made, False)

    def plan_after_update(
        self, run: Running, need: float, old: SegmentCall
    ) -> tuple[sample_rules.Continuation, SegmentCall | None, bool]:
        """A segment planned under the weights before an update and held until its end, not
        started: planned again under the new version, as a segment the update cut is, so
        its owner's `max_staleness` judges it now (it would otherwise extend a prefix the
        rule no longer allows). A snapshot the old plan was to restore (under the old
        weights) or to free is freed by the new plan's engine call."""
        held = old.slot if old.restore else old.drop
        if old.restore:
            run.restore_planned = False
            self.places.clear(run.sample)
        return self.continue_after_cut(run, need, held)

    def continue_after_cut(
        self, run: Running, need: float, held: Slot | None = None
    ) -> tuple[sample_rules.Continuation, SegmentCall | None, bool]:
        """The next segment of a sample cut by a weight update, under the version now.
        `held`: where a snapshot lives that the new plan must free (None: none)."""
        sample = run.sample
        version = self.versions.now()
        cont = sample_rules.plan_continuation(
            sample,
            version,
            run.max_staleness,
            self.versions.history,
            run.override_params,
            run.owner == BACKGROUND,
        )
        if cont.restarted:
            self.planner.count_restart(sample, run.tally)
        call = self.planner.plan(sample, run.owner, cont, False, held)
        run.planned_version = version
        if call is not None:
            run.rid, run.slot, run.restore_planned = call.rid, call.slot, call.restore
            self.planner.add_load(call.slot, 1, need)
        elif held is not None:
            run.unplanned_drop = held
        return cont, call, False
