"""Background generation: groups that keep generating between calls, so the engine is never
idle while the trainer trains.

A call with `on_quota: continue` hands the unfinished groups it started to the background
when it answers; `POST /groups` with `start: background` hands in new ones. Here is where a
call ends and the background begins:

1. The background runs only while no call is active (it never slows a call down). A call
   first takes over the groups still generating, oldest first, as many as its running
   target holds (`yielding`, `hand_over`): they pass to it in place, their segments keep
   generating, and they count toward its quota. The rest give way (`give_way`): their
   segments stop with a KV snapshot, the groups are persisted and handed back to the idle
   buffer, and the call claims them like any buffered group (finished ones first, the rest
   resuming from their snapshots). A resume, a delete or an abort pauses it all
   (`paused()`).
2. When the last of those ends, the background takes its groups again (`kick`): held in
   place (`PartialBuffer.hold_in_place`), so they stay listed and counted as buffered, with
   `state: running`, and starts their unfinished samples under the admission bound shared
   with calls; groups that do not fit, and groups handed in while a round runs, wait for a
   later round (starting those at once beside the running ones was measured: more samples
   went past `max_staleness` and restarted, fewer tokens per wall second in `make
   bench-async`). A `continue` call that ends while nothing else holds the background hands
   its groups still generating over in place (`adopt`): their segments never stop, they are
   held in place at once, and the round they run in starts the rest once the call has ended.
3. A group whose members have all finished is persisted and handed back at once: `state:
   finished`, delivered without waiting by the next call that asks for buffered groups.
4. A weight push cuts background segments at the version boundary like any (`segment_runner.py`);
   a continuation past the `max_staleness` it was handed with restarts from its prompt. An
   abort or a restart forget the group here: it stays buffered, idle. A group stays wanted
   while a call holds it without delivering it (taken over generating, or claimed idle): the
   background takes it again once no call runs. Who holds a group is read from the holder
   map only: one an answer holds right now is passed over, not forgotten.
5. The bound travels with the group until it leaves the server (delivered, dropped,
   deleted): when a call claims a group put here, each member whose oldest kept token is
   then more than the bound behind restarts from its prompt, finished or not
   (`restart_stale`, decided in the step the claim lands in; a member taken over generating
   was judged at its last cut, and is judged by the call's rule from then on, which is why a
   member whose cut's continuation is not planned yet is not taken over). A group that
   finished here and is reopened by such a restart is wanted here again; a running member
   handed back past the bound is not adopted in place. Otherwise a group that finished here,
   or that a call claimed before the background ran it again after a push, would be
   delivered staler.
What is durable is what was persisted: at a hand-back (pause, finish) and at every call's
answer; tokens generated since then are not yet acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager

from april_client.protocol import Group, Sample
from april_server.buffer.buffer_index import open_footprint
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.segment_planner import SegmentPlanner
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import BACKGROUND, CallTally, Running
from april_server.engine.snapshot_places import SnapshotPlaces
from april_server.engine.versions import WeightVersions
from april_server.engine.weight_cut import WeightCut
from april_server.rules import samples as sample_rules
from april_server.rules.inflight import Admission, kv_need
from april_server.rules.placement import Slot
from april_server.runtime.live_calls import LiveCalls
from april_server.runtime.run_to_end import run_to_end

logger = logging.getLogger(__name__)
OWNER = BACKGROUND


class Background:
    def __init__(
        self,
        buffer: PartialBuffer,
        segments: SegmentRunner,
        planner: SegmentPlanner,
        weight_cut: WeightCut,
        versions: WeightVersions,
        admission: Admission,
        calls: LiveCalls,
        places: SnapshotPlaces,
    ) -> None:
        """`calls`: read only here: the background runs only while no call does."""
        self.buffer = buffer
        self.segments = segments
        self.planner = planner  # the admission bound; counts staleness restarts
        self.weight_cut = weight_cut  # whether a weight update holds running segments
        self.versions = versions  # how far behind a group's tokens are
        self.admission = admission  # whether a group fits beside what runs
        self.calls = calls
        self.places = places  # where each sample's snapshot lives
        self.wanted: dict[str, int | None] = {}  # group id -> the max_staleness it runs under
        self.handed_by: dict[str, str] = {}  # group id -> the call that handed it in
        # group id -> the max_staleness it was put here with, until a call claims it (5.)
        self.bounds: dict[str, int | None] = {}
        # group id -> (max_staleness, handed_by) of groups that finished here: a staleness
        # restart at a call's claim reopens them (5.), and they are wanted here again.
        self.resting: dict[str, tuple[int | None, str]] = {}
        self.tally = CallTally()
        self._holds = 0  # calls and other operations that have paused the background
        self.pauses = 0  # pauses that found background segments running, and their time
        self.pause_s = 0.0
        self._task: asyncio.Task[None] | None = None
        # The running round's segment tasks (task -> group id), how many each group still
        # runs, and a wake-up for when a call took some of them over (`hand_over`).
        self._ends: dict[asyncio.Task[None], str] = {}
        self._left: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._fill_due = False  # a round is to take and start the wanted groups (`kick`)
        # A kick came while a round ran (groups handed in, a holder that let go, maybe before
        # the round it stopped had ended: its stopped members are still held by it then, and
        # no fill of this round takes them): they start in the next round, which this round's
        # end begins.
        self._kicked = False
        self._failing = False  # the round failed: it stops everything and hands back

    # ---- what the rest of the server calls -------------------------------------------------

    def add(self, group_ids: Iterable[str], max_staleness: int | None, handed_by: str = "") -> None:
        """Keep these buffered groups generating between calls (from the next round on)."""
        for gid in group_ids:
            self.wanted[gid] = max_staleness
            self.handed_by[gid] = handed_by
            self.bounds[gid] = max_staleness
        self.kick()

    def forget(self, group_ids: Iterable[str] | None = None, gone: bool = False) -> None:
        """Stop wanting these groups (all: None) in the background; they stay buffered.
        `gone`: they left the buffer, so their staleness bound (5.) goes too."""
        if group_ids is None:
            self.wanted.clear()
            self.handed_by.clear()
            self.resting.clear()
        for gid in group_ids or ():
            self.wanted.pop(gid, None)
            self.handed_by.pop(gid, None)
            self.resting.pop(gid, None)
            if gone:
                self.bounds.pop(gid, None)

    async def restart_stale(self, groups: Iterable[Group], tally: CallTally) -> None:
        """A call claims these buffered groups (see the module docstring, 5). Decided and
        recorded before the first `await`, in the step the call's claim landed in: an answer
        waiting for the group must not start a member before its bound was applied. A
        restarted member's snapshot is of no use any more: freed after, or it would stay held
        on its engine. A group that had finished here and was reopened by a restart is wanted
        here again."""
        if not self.bounds:
            return
        useless = []
        for g in groups:
            bound = self.bounds.get(g.group_id)
            if bound is None:  # not put here, or put here without a bound
                continue
            for s in g.samples:
                if self.segments.is_running(s.sample_id):  # taken over: judged at every cut
                    continue
                if self._past_bound(s, bound):
                    useless.append((s.sample_id, self.places.of(s)))
                    sample_rules.restart_for_staleness(s)
                    self.planner.count_restart(s, tally)
                    rested = self.resting.pop(g.group_id, None)
                    if rested is not None:
                        self.wanted[g.group_id], self.handed_by[g.group_id] = rested
        held = [(sample_id, slot) for sample_id, slot in useless if slot is not None]
        if held:
            # To the end even if the call is cancelled meanwhile (its client went away): the
            # restart cleared where each snapshot lives, so no one else would ever free it.
            await run_to_end(self._drop(held))

    async def _drop(self, held: list[tuple[str, Slot]]) -> None:
        for sample_id, slot in held:
            await self.segments.drop(sample_id, slot)

    @asynccontextmanager
    async def yielding(self) -> AsyncIterator[None]:
        """A call's hold: like `paused()`, but what runs keeps running until the call has
        taken over the groups it wants (`hand_over`) and stopped the rest (`give_way`)."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            self.kick()

    def may_adopt(self, owner: str) -> bool:
        """Whether the ending call `owner` may hand its groups still generating over in place:
        no other call or operation holds the background, no weight update holds cut segments
        (those continue under their owner's rule after it), and no round is failing (it hands
        back all it holds)."""
        return (
            self._holds == 1
            and list(self.calls) == [owner]
            and self.weight_cut.updated.is_set()
            and not self._failing
        )

    def adopt(self, owner: str, going: dict[str, list[Running]]) -> list[str]:
        """The ending call `owner`'s groups (with the runs it started) pass here generating,
        held in place; call after they were persisted and added (`add`). Returns the groups
        it did not take: the call stops their runs. A group none of whose segments is still
        running is not taken either: what its last segment recorded may postdate the persist."""
        if not self.may_adopt(owner):
            return list(going)
        refused = []
        for gid, runs in going.items():
            pending = [r for r in runs if not r.task.done()]
            if (
                gid not in self.wanted
                or not pending
                or any(r.stopping for r in pending)
                or any(self._past_bound(r.sample, self.wanted[gid]) for r in pending)
            ):
                # A member already past the bound it would run under here: stopped and
                # buffered, its continuation here restarts it (5.).
                refused.append(gid)
                continue
            self.buffer.pass_in_place(gid, OWNER)
            self.segments.pass_runs(pending, OWNER)
            # Planned from now on under the background's bound (5.).
            self.segments.judge_runs(pending, self.tally, self.wanted[gid])
            for r in pending:
                self._ends[r.task] = gid
            self._left[gid] = len(pending)
        if len(refused) < len(going):
            self._changed.set()
            self._fill_due = True  # once the call has ended, as a round starting would
            if self._task is None:  # it fills once the call has ended (`kick`)
                self._task = asyncio.get_running_loop().create_task(self._round())
        return refused

    def _past_bound(self, sample: Sample, bound: int | None) -> bool:
        """Whether the sample's oldest kept token is more than `bound` versions behind now."""
        if bound is None or not sample.segments:
            return False
        versions = self.versions
        lag = sample_rules.version_lag(
            sample.segments[0].weight_version, versions.now(), versions.history
        )
        return bool(lag > bound)

    def hand_over(self, owner: str, take: Callable[[Group, int], bool]) -> list[Group]:
        """Running groups pass to the call `owner`, oldest first, while `take(group, running
        members)` accepts them; their segments keep generating, now the call's."""
        if not self.weight_cut.updated.is_set():
            # A weight update holds cut segments: they continue after it under the rule of
            # whoever owns them; stopped and claimed instead, they are judged by their bound.
            return []
        index = self.buffer.idle
        running = sorted(
            (e.seq, gid)
            for gid in self.running_groups()
            if gid in self._left and (e := index.get(gid)) is not None
        )
        taken = []
        for _, gid in running:
            group = self.buffer.claimed[gid]
            runs = self.segments.runs_in(gid)
            tasks = [t for t, g in self._ends.items() if g == gid]
            # An abort is stopping it, or a push cut it and its continuation is not planned
            # yet under the background's bound (the cut may not even have landed), or its
            # segment waits for a healthy engine under the plan the background judged (it has
            # not generated yet: taken over, it would run under no rule of the call's): not the
            # call's. Nor while a segment task of it has left `running` but still records its
            # end (awaiting its snapshot's release): the call tracks only the runs it is
            # handed, so nobody would wait for that task, which would go on writing to a group
            # the call holds (and the call would start that member again beside it).
            if any(r.stopping or r.cut or r.resuming or r.placing for r in runs):
                continue
            run_tasks = {r.task for r in runs}
            if any(not t.done() and t not in run_tasks for t in tasks):
                continue
            if not take(group, len(runs)):
                break
            self.buffer.pass_held(gid, owner)
            self.segments.pass_runs(runs, owner)
            for t in tasks:
                del self._ends[t]
            del self._left[gid]
            taken.append(group)
        if taken:
            self._changed.set()
        return taken

    async def give_way(self) -> None:
        """Stop what the call did not take over (see the module docstring, 1)."""
        await self._stop()

    def handed_in_by(self, batch_id: str) -> set[str]:
        """The groups a call (its batch id) left generating here."""
        return {gid for gid, b in self.handed_by.items() if b == batch_id}

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold the background off while the body runs (see the module docstring, 1)."""
        self._holds += 1
        try:
            await self._stop()
            yield
        finally:
            self._holds -= 1
            self.kick()

    def sample_ids(self, among: set[str] | None = None) -> list[str]:
        """Every sample of the groups wanted here (running now or not), or of those `among`."""
        idle = self.buffer.idle
        return [
            f"{gid}/{i}"
            for gid in self.wanted
            if among is None or gid in among
            if (e := idle.get(gid)) is not None
            for i in range(e.num_samples)
        ]

    def running_groups(self) -> set[str]:
        return self.buffer.held_by(OWNER)

    def kick(self) -> None:
        if not self.wanted or self._holds or self.calls:
            return
        if self._task is None:
            self._fill_due = True
            self._task = asyncio.get_running_loop().create_task(self._round())
        else:  # the round checks whether a hand-over in place left it a fill to do
            self._kicked = True
            self._changed.set()

    def check(self) -> None:
        """Its views against the holder map (`RolloutManager.check_integrity`)."""
        buf = self.buffer
        held = buf.held_by(OWNER)
        assert set(self._left) <= held, f"running {sorted(set(self._left) - held)} not held"
        assert set(self._ends.values()) <= set(self._left), "a segment of a group not running"
        for gid in self.wanted:
            assert buf.known(gid), f"the background wants {gid}, which the server does not hold"
        for r in self.segments.runs_of(OWNER):
            assert r.sample.group_id in held, f"{r.sample.sample_id} runs, group not held"

    # ---- one round: hold, run, hand back ----------------------------------------------------

    async def _stop(self) -> None:
        task = self._task
        if task is None:
            return
        t0 = time.perf_counter()
        runs = self.segments.runs_of(OWNER)
        await self.segments.stop(runs, "snapshot")
        await asyncio.wait([task])
        if runs:
            self.pauses += 1
            self.pause_s += time.perf_counter() - t0

    async def _round(self) -> None:
        waiting: list[str] = []
        ends, left = self._ends, self._left
        try:
            await self.planner.admission_ready()
            while True:
                if self._fill_due and not self._holds and not self.calls:
                    self._fill_due = False
                    waiting = await self._fill()
                if not ends:
                    break
                self._changed.clear()
                changed = asyncio.ensure_future(self._changed.wait())
                done, _ = await asyncio.wait([*ends, changed], return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                for t in done:
                    if t not in ends:  # the wake-up, or a segment a call took over meanwhile
                        continue
                    gid = ends.pop(t)  # type: ignore[arg-type]
                    left[gid] -= 1
                    if left[gid] == 0:
                        del left[gid]
                        await self._hand_back([gid])
        except Exception:  # the background must never take the server down
            logger.exception("april: background round failed; its groups stay buffered")
            # Its groups go back only once every segment task of it has ended: one that left
            # `running` may still record its end (awaiting its snapshot's release), into a body
            # that must still be held then; and nothing more is handed over in place meanwhile
            # (`may_adopt`), or it would go back generating.
            self._failing = True
            runs = self.segments.runs_of(OWNER)
            await self.segments.stop(runs, "tokens")
            pending = [t for t in ends if not t.done()]
            if pending:
                await asyncio.wait(pending)
            try:
                await self._hand_back(list(self.running_groups()))
            except Exception:  # the store fails (a full disk): never keep them held
                logger.exception(
                    "april: the background could not persist its groups; they go back to "
                    "the buffer as last persisted"
                )
                self.buffer.release_in_place(OWNER)
        finally:
            self._task = None
            self._failing = False
            self._ends.clear()
            self._left.clear()
        kicked, self._kicked = self._kicked, False
        if (waiting or kicked) and not self._holds:
            # Groups that found no room get their turn; so do those a kick concerned while
            # this round ran (handed in, or stopped by a holder that let go before the round
            # ended: it cannot start a round that still runs).
            self.kick()

    async def _fill(self) -> list[str]:
        """Hold the wanted groups in place and start what fits; returns those that did not."""
        waiting: list[str] = []
        for gid in [g for g in self.wanted if not self.buffer.known(g)]:
            self.forget([gid], gone=True)  # delivered, deleted or dropped meanwhile
        # Those someone else holds now (an answer being made durable) are left to a later
        # round: `take_in_place` passes them over, and their holder kicks when it lets go.
        groups = await self.buffer.hold_in_place(list(self.wanted), OWNER)
        ends, left = self._ends, self._left
        touched: list[str] = []  # looked at by `start_group`, nothing started
        for g in groups if not self._holds else ():  # paused while holding: start nothing
            n = self._start(g.group_id, ends, bool(ends))
            if n is None:
                waiting.append(g.group_id)  # no room now: handed back, runs later
            elif n:
                left[g.group_id] = n
            else:
                touched.append(g.group_id)  # finished, awaiting, or a member out of budget
        # Those not started were only read: back as they were, without a write (a round
        # would otherwise rewrite every group that found no room, once per round).
        seen = set(touched) | set(left)
        self.buffer.release_in_place(OWNER, [g.group_id for g in groups if g.group_id not in seen])
        await self._hand_back(touched)  # one commit: `start_group` may have marked members
        return waiting

    def _start(self, gid: str, ends: dict[asyncio.Task[None], str], others: bool) -> int | None:
        """Start the group's unfinished samples whole, if it fits beside what runs (the
        first always does); None when it does not fit now."""
        group = self.buffer.claimed[gid]
        unfinished, context, remaining = open_footprint(group)
        if (
            unfinished
            and others
            and not self.admission.fits(unfinished, kv_need(context, remaining))
        ):
            return None
        started = self.segments.start_group(group, OWNER, self.tally, self.wanted.get(gid))
        for task in started:
            ends[task] = gid
        return len(started)

    async def _hand_back(self, group_ids: list[str]) -> None:
        """Persist these held groups and return them to the idle buffer; finished ones leave
        the background."""
        held = [gid for gid in group_ids if self.buffer.owner_of(gid) == OWNER]
        if not held:
            return
        await self.buffer.persist([self.buffer.claimed[g] for g in held], [])
        for gid in held:
            if sample_rules.group_finished(self.buffer.claimed[gid]) and gid in self.wanted:
                rest = (self.wanted[gid], self.handed_by.get(gid, ""))
                self.forget([gid])
                self.resting[gid] = rest
        self.buffer.release_in_place(OWNER, held)
