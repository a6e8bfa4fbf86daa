"""`POST /april/v1/abort`: stop samples by batch, group, sample or all, and say where they are.

1. Every call that holds a group it names stops waiting for that group's answers and will not
   start it again (`give_up`); the background forgets the named groups (they stay buffered,
   idle).
2. Everything in its scope that generates stops with the `keep` asked for (snapshot, tokens,
   drop).
3. It answers the state of every sample in its scope. Idempotent: an abort naming a finished
   call is a no-op, not a 404.
Who holds a group can change at every `await` (a call claims a named idle group, a `continue`
call hands one to the background): 1 and 2 are resolved again after each, from the holder
map, and it answers only once, in one step, nothing in its scope generates and no call or the
background counts on a named group.
"""

from __future__ import annotations

from dataclasses import dataclass

from april_client.protocol import AbortReq, AbortResp, Group, Sample
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import BACKGROUND, Counters, Running
from april_server.runtime.background import Background
from april_server.runtime.live_calls import LiveCalls
from april_server.wire.errors import not_found
from april_server.wire.ids import split_sample_id


@dataclass(eq=False)
class Abort:
    calls: LiveCalls
    buffer: PartialBuffer
    background: Background
    segments: SegmentRunner
    counters: Counters

    async def __call__(self, req: AbortReq) -> AbortResp:
        calls, buffer, background = self.calls, self.buffer, self.background
        self.counters.abort_calls += 1
        if req.batch_id is not None:
            if req.batch_id not in calls and not calls.ended_recently(req.batch_id):
                raise not_found(f"unknown batch_id {req.batch_id!r}")
        # What it names must exist (404), checked before anything changes.
        for gid in req.group_ids or []:
            if not buffer.known(gid):
                raise not_found(f"unknown group_id {gid!r}")
        await buffer.read_samples(req.sample_ids or [])
        named = self._groups_of(req)
        # Background samples stop like any (with a snapshot when they are paused, the keep
        # asked for when they are aborted) and are no longer wanted there.
        scope: set[str] = set(background.sample_ids(None if req.all else named))
        self._give_up(req, named)
        runs = self._in_scope(req, named, scope)
        scope.update(r.sample.sample_id for r in runs)
        await self.segments.stop(runs, req.keep)
        async with background.paused():
            groups = await buffer.read_bodies(list(dict.fromkeys(req.group_ids or [])))
            for g in groups.values():
                scope.update(s.sample_id for s in g.samples)
            scope.update(req.sample_ids or [])
            while True:
                self._give_up(req, named)
                runs = self._in_scope(req, named, scope)
                if runs:
                    scope.update(r.sample.sample_id for r in runs)
                    await self.segments.stop(runs, req.keep)
                    continue
                bodies = await buffer.read_bodies(sorted({_group(sid) for sid in scope}))
                self._give_up(req, named)
                if not self._in_scope(req, named, scope):  # nothing started during the read
                    # Groups that left meanwhile (delivered, deleted) are not reported.
                    return AbortResp(samples=_members(bodies, sorted(scope)))

    def _groups_of(self, req: AbortReq) -> set[str]:
        """The groups an abort names (a finished call's: those it left in the background)."""
        named = set(req.group_ids or []) | {_group(s) for s in req.sample_ids or []}
        if req.batch_id is not None:
            named |= self.background.handed_in_by(req.batch_id)
        return named

    def _give_up(self, req: AbortReq, named: set[str]) -> None:
        """Step 1 as the holder map says now: every call holding a named group gives it up
        (all of its groups, for `all` and its own batch), and the background forgets them."""
        for call in list(self.calls.values()):
            if req.all or req.batch_id == call.state.batch_id:
                call.turns.give_up(None)
                continue
            mine = named & self.buffer.held_by(call.state.batch_id)
            if mine - call.state.given_up:
                call.turns.give_up(mine)
        self.background.forget(None if req.all else named)

    def _in_scope(self, req: AbortReq, named: set[str], scope: set[str]) -> list[Running]:
        """Step 2: what of its scope generates now."""
        return [
            r
            for sid, r in self.segments.running.items()
            if req.all
            or sid in scope
            or (req.batch_id is not None and r.owner == req.batch_id)
            or (r.owner == BACKGROUND and r.sample.group_id in named)
        ]


def _members(bodies: dict[str, Group], sample_ids: list[str]) -> list[Sample]:
    out = []
    for sid in sample_ids:
        parts = split_sample_id(sid)
        g = bodies.get(parts[0]) if parts is not None else None
        if parts is not None and g is not None and parts[1] < len(g.samples):
            out.append(g.samples[parts[1]])
    return out


def _group(sample_id: str) -> str:
    parts = split_sample_id(sample_id)
    return sample_id if parts is None else parts[0]
