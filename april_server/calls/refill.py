"""Step 2 of a call: start groups whole, in order, under the running target and the engine's
admission bound; claim buffered groups only as they start; count groups as they finish."""

from __future__ import annotations

import asyncio
from typing import Any

from april_client.protocol import Group, GroupFinishedEvent
from april_server.buffer.buffer_index import BufferEntry, open_footprint
from april_server.calls.turns_in_call import TurnsInCall
from april_server.rules import samples as S
from april_server.rules.inflight import kv_need


class Refill(TurnsInCall):
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
                active[gid] = active.get(gid, 0) + started  # an answered member may run
                self.peak_running = max(self.peak_running, len(tasks))
            elif S.group_finished(mgr.groups[gid]):
                self._emit_finished(gid)
            else:  # nothing runnable: its members await input
                self._announce_awaiting(gid)

    async def _take_over_background(
        self,
        tasks: dict[asyncio.Task[None], str],
        active: dict[str, int],
        limit: int,
        sample_target: int,
    ) -> None:
        """Before step 2: the background groups still generating pass to this call, oldest
        first, as many as its running target takes; they keep generating and count toward its
        quota. The rest of the background stops (`background.py`, 1)."""
        mgr = self.mgr
        if self.req.resume_first:
            room = [0, 0]  # groups, unfinished samples taken

            def take(group: Group, running: int) -> bool:
                unfinished = sum(1 for s in group.samples if not S.is_finished(s))
                if room[0] and (room[0] >= limit or room[1] + unfinished > sample_target):
                    return False
                room[0] += 1
                room[1] += unfinished
                return True

            groups = mgr.background.hand_over(self.batch_id, take)
            self.group_ids.extend(g.group_id for g in groups)
            await mgr.background.restart_stale(groups, self.tally)
            for g in groups:
                gid = g.group_id
                self.started.add(gid)
                runs = [r for r in mgr.running.values() if r.sample.group_id == gid]
                for r in runs:  # from now on planned, and counted, as this call's
                    r.max_staleness, r.tally = self.req.max_staleness, self.tally
                    tasks[r.task] = gid
                n = len(runs) + self._start_group(gid, tasks)
                if n:
                    active[gid] = active.get(gid, 0) + n
                    self.peak_running = max(self.peak_running, len(tasks))
                elif S.group_finished(g):
                    self._emit_finished(gid)
        await mgr.background.give_way()

    async def _next_group(
        self, running: int, active: int, limit: int, sample_target: int
    ) -> str | None:
        """The next group to start, if it fits: buffered ones first (oldest first, claimed now,
        as many as fit at once), then the sent ones. None: wait for a running group to end."""
        mgr = self.mgr
        if not self.ready and self.req.resume_first and mgr.buffer.idle.claimable:
            await self._claim_buffered(running, active, limit, sample_target)
            if not self.ready and mgr.buffer.idle.claimable:
                return None  # the oldest buffered group does not fit yet
        for queue in (self.ready, self.fresh):  # an abort named these meanwhile: not started
            while queue and queue[0] in self.given_up:
                queue.popleft()
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

        picked = mgr.buffer.take_oldest(fits, self.batch_id)
        if picked:
            # Recorded as this call's before the bodies are read: an abort naming one of them
            # meanwhile finds it here and the call gives it up.
            groups = await self._arrive(picked)
            self.ready.extend(g.group_id for g in groups)
            await mgr.background.restart_stale(groups, self.tally)

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
            for e in mgr.buffer.idle.claimable_oldest():
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
            if gid in self.mgr.groups:
                self._announce_awaiting(gid)

    def _start_group(self, gid: str, tasks: dict[asyncio.Task[None], str]) -> int:
        group, limit = self.mgr.groups[gid], self.req.max_staleness
        n = self.mgr.segments.start_group(group, self.batch_id, self.tally, limit, tasks)
        if n:
            self.started.add(gid)
        return n

    def _emit_finished(self, gid: str) -> None:
        if not self.quota.finish(gid):
            return  # counted and announced already
        if self.events is not None and len(self.quota.accepted) <= self.quota.target:
            event = GroupFinishedEvent(group=self.mgr.groups[gid], batch_id=self.batch_id)
            self.events.put_nowait(event)
