"""Steps 3-6 of a call: size the running set; start groups whole, in order, under the
running target and the engine's admission bound; claim buffered groups only as they start;
count groups as they finish."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from april_client.protocol import Group, GroupFinishedEvent
from april_server.buffer.buffer_index import BufferEntry, open_footprint
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.calls.state import CallState
from april_server.calls.turns_in_call import TurnsInCall
from april_server.engine.segment_runner import SegmentRunner
from april_server.rules import samples as sample_rules
from april_server.rules.inflight import kv_need
from april_server.runtime.background import Background
from april_server.runtime.pool_sizing import PoolSizing


@dataclass(eq=False)
class Refill:
    state: CallState
    turns: TurnsInCall
    buffer: PartialBuffer
    segments: SegmentRunner
    background: Background
    sizing: PoolSizing  # the running target; what fits beside what runs

    async def arrive(self, entries: list[BufferEntry]) -> list[Group]:
        """Groups just taken for this call (`PartialBuffer.take*`): counted as its own at once,
        before their bodies are read, and those whose body never came left out again."""
        state = self.state
        state.group_ids.extend(e.group_id for e in entries)
        groups: list[Group] = []
        try:
            groups = await self.buffer.arrive(entries)
        finally:  # a failed read handed them all back (`arrive`); a missing body, that one
            got = {g.group_id for g in groups}
            lost = {e.group_id for e in entries} - got
            if lost:
                state.group_ids = [gid for gid in state.group_ids if gid not in lost]
        return groups

    async def refill(self, limit: int, sample_target: int) -> None:
        """Step 4: start groups whole, in order, while under the running target, the groups
        limit and the engine's admission bound."""
        state = self.state
        while len(state.active) < self.group_limit(limit) and not state.quota.met:
            gid = await self._next_group(self.group_limit(limit), sample_target)
            if gid is None:
                return
            started = self._start_group(gid)
            if started:
                state.active[gid] = state.active.get(gid, 0) + started  # an answered member may run
                state.note_running()
            elif sample_rules.group_finished(self.buffer.claimed[gid]):
                self._emit_finished(gid)
            else:  # nothing runnable: its members await input
                self.turns.announce_awaiting(gid)

    async def take_over_background(self, limit: int, sample_target: int) -> None:
        """Before step 4: the background groups still generating pass to this call, oldest
        first, as many as its running target takes; they keep generating and count toward its
        quota. The rest of the background stops (`background.py`, 1)."""
        state = self.state
        limit = self.group_limit(limit)
        if state.req.resume_first:
            room = [0, 0]  # groups, unfinished samples taken

            def take(group: Group, running: int) -> bool:
                unfinished = sum(1 for s in group.samples if not sample_rules.is_finished(s))
                if room[0] and (room[0] >= limit or room[1] + unfinished > sample_target):
                    return False
                room[0] += 1
                room[1] += unfinished
                return True

            groups = self.background.hand_over(state.batch_id, take)
            state.group_ids.extend(g.group_id for g in groups)
            await self.background.restart_stale(groups, state.tally)
            for g in groups:
                gid = g.group_id
                state.started.add(gid)
                runs = self.segments.runs_in(gid)
                # From now on planned, and counted, as this call's.
                self.segments.judge_runs(runs, state.tally, state.req.max_staleness)
                for r in runs:
                    state.tasks[r.task] = gid
                n = len(runs) + self._start_group(gid)
                if n:
                    state.active[gid] = state.active.get(gid, 0) + n
                    state.note_running()
                elif sample_rules.group_finished(g):
                    self._emit_finished(gid)
                else:  # its last segments reached turn stops before the hand-over: say so
                    self.turns.announce_awaiting(gid)
        await self.background.give_way()

    async def _next_group(self, limit: int, sample_target: int) -> str | None:
        """The next group to start, if it fits: buffered ones first (oldest first, claimed now,
        as many as fit at once), then the sent ones. None: wait for a running group to end."""
        state, idle = self.state, self.buffer.idle
        running = len(state.tasks)
        if not state.ready and state.req.resume_first and idle.claimable:
            await self._claim_buffered(running, len(state.active), limit, sample_target)
            if not state.ready and idle.claimable:
                return None  # the oldest buffered group does not fit yet
        for queue in (state.ready, state.fresh):  # an abort named these meanwhile: not started
            while queue and queue[0] in state.given_up:
                queue.popleft()
        queue = state.ready or state.fresh
        if not queue:
            return None
        group = self.buffer.claimed[queue[0]]
        unfinished, context, left = open_footprint(group)
        need = kv_need(context, left)
        # Groups start whole; the running target is a ceiling, not a hint (a group larger
        # than the target may still run alone).
        if running and (
            running + unfinished > sample_target or not self.sizing.admission.fits(unfinished, need)
        ):
            return None
        return queue.popleft()

    async def _claim_buffered(
        self, running: int, active: int, limit: int, sample_target: int
    ) -> None:
        """Claim the oldest idle groups that fit now (finished ones while the quota can use
        them); they leave the index at once, their bodies are read off the event loop."""
        state, admission = self.state, self.sizing.admission
        room_samples = room_groups = 0
        room_tokens = 0.0
        finished_wanted = state.quota.target - len(state.quota.accepted)

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
                or not admission.fits(room_samples + e.unfinished, room_tokens + need)
            ):
                return False
            room_samples += e.unfinished
            room_tokens += need
            room_groups += 1
            return True

        picked = self.buffer.take_oldest(fits, state.batch_id)
        if picked:
            # Recorded as this call's before the bodies are read: an abort naming one of them
            # meanwhile finds it here and the call gives it up.
            groups = await self.arrive(picked)
            state.ready.extend(g.group_id for g in groups)
            await self.background.restart_stale(groups, state.tally)

    async def inflight_limits(self) -> tuple[int, int]:
        """Step 3: (max groups, max running samples) for this call. An integer pins the groups;
        "auto" sizes the running batch from the engine's measured step-time curve."""
        state, claimed, idle = self.state, self.buffer.claimed, self.buffer.idle
        req = state.req
        if req.max_inflight_groups != "auto":
            state.inflight_target = None
            return req.max_inflight_groups, 1 << 30
        # O(target + sent), not O(buffer): the index keeps the buffered counts.
        sizes = [len(claimed[gid].samples) for gid in state.ready][: req.target_groups]
        if req.resume_first:
            for e in idle.claimable_oldest():
                if len(sizes) >= req.target_groups:
                    break
                sizes.append(e.num_samples)
        for gid in state.fresh:
            if len(sizes) >= req.target_groups:
                break
            sizes.append(len(claimed[gid].samples))
        demand = sum(sizes)  # what a synchronous step would run
        can_run = sum(len(claimed[g].samples) for g in [*state.ready, *state.fresh])
        if req.resume_first:
            can_run += idle.unfinished_samples
        size = round(demand / len(sizes)) if sizes else None
        # Whether what it finishes will tell lengths (agent episodes' lengths are their
        # tools' as much, and are not counted): the groups it holds now, O(target + sent).
        mine = [claimed[g] for g in [*state.ready, *state.fresh]]
        single_turn = bool(mine) and all(g.samples[0].turn_rule is None for g in mine)
        pool = await self.sizing.decide(
            demand, max(can_run, 1), req.target_groups, size, req.max_staleness, single_turn
        )
        state.inflight_target = pool.decision.running_target
        state.extra_groups, state.goodput = pool.extra_groups, pool.goodput
        return 1 << 30, pool.decision.running_target

    def group_limit(self, limit: int) -> int:
        """Groups this call may have in progress now: `limit`, and for an "auto" call sized
        for goodput, the groups its quota still needs plus its extra ones (so it ends with at
        most that many carried over; a rejected group re-opens the room)."""
        state = self.state
        if state.extra_groups is None:
            return limit
        needed = max(0, state.quota.target - len(state.quota.accepted))
        return min(limit, needed + state.extra_groups)

    def collect(self, done: set[asyncio.Task[None]]) -> None:
        """Step 6: account for finished segment tasks; a group counts once all its members
        ended."""
        state, claimed = self.state, self.buffer.claimed
        for t in done:
            gid = state.tasks.pop(t)
            state.active[gid] -= 1
            if state.active[gid] == 0:
                del state.active[gid]
                if sample_rules.group_finished(claimed[gid]):
                    self._emit_finished(gid)
            if gid in claimed:
                self.turns.announce_awaiting(gid)

    def _start_group(self, gid: str) -> int:
        state = self.state
        group, limit = self.buffer.claimed[gid], state.req.max_staleness
        started = self.segments.start_group(group, state.batch_id, state.tally, limit)
        for task in started:
            state.tasks[task] = gid
        if started:
            state.started.add(gid)
        return len(started)

    def _emit_finished(self, gid: str) -> None:
        state = self.state
        if not state.quota.finish(gid):
            return  # counted and announced already
        if state.events is not None and len(state.quota.accepted) <= state.quota.target:
            state.emit(GroupFinishedEvent(group=self.buffer.claimed[gid], batch_id=state.batch_id))
