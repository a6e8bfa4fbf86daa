"""`GET /april/v1/partials` (the idle buffer, a page at a time, oldest first) and
`GET /april/v1/partials/{group_id}` (one group, idle or held): each group as it stands now,
with its state and what it would start under now."""

from __future__ import annotations

import time
from dataclasses import dataclass

from april_client.protocol import Group, PartialsResp
from april_server.buffer.buffer_index import PartialsFilter
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import BACKGROUND
from april_server.rules import samples as sample_rules
from april_server.rules import turns as turn_rules
from april_server.rules.lengths import LengthModel


@dataclass(eq=False)
class Partials:
    buffer: PartialBuffer
    segments: SegmentRunner  # who runs; which snapshots the store still holds
    lengths: LengthModel  # what a group would start under now

    async def page(self, start: int, limit: int, where: PartialsFilter) -> PartialsResp:
        entries, next_seq = self.buffer.idle.page(start, limit, where, time.time())
        bodies = await self.buffer.read_bodies([e.group_id for e in entries])
        groups = [bodies[e.group_id] for e in entries if e.group_id in bodies]
        await self.segments.refresh([s for g in groups for s in g.samples])
        cursor = None if next_seq is None else str(next_seq)
        return PartialsResp(groups=[self.listed(g) for g in groups], next_cursor=cursor)

    async def one(self, group_id: str) -> Group:
        return self.listed(await self.buffer.read_group(group_id))

    def listed(self, g: Group) -> Group:
        g.age_s = round(time.time() - g.created_at, 3)
        if self.buffer.owner_of(g.group_id) == BACKGROUND or any(
            self.segments.is_running(s.sample_id) for s in g.samples
        ):
            g.state = "running"
        elif sample_rules.group_finished(g):
            g.state = "finished"
        else:
            g.state = "awaiting" if any(turn_rules.awaiting(s) for s in g.samples) else "idle"
            self.lengths.mark(g)  # what it would start under now (running: as it did)
        return g
