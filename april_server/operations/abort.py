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

from april_client.protocol import AbortReq, AbortResp, Group, Sample
from april_server.engine.segment_state import BACKGROUND, Running
from april_server.runtime.manager import RolloutManager
from april_server.wire.errors import not_found
from april_server.wire.ids import split_sample_id


async def abort(mgr: RolloutManager, req: AbortReq) -> AbortResp:
    mgr.counters.abort_calls += 1
    if req.batch_id is not None:
        if req.batch_id not in mgr.calls and req.batch_id not in mgr.finished_batches:
            raise not_found(f"unknown batch_id {req.batch_id!r}")
    # What it names must exist (404), checked before anything changes.
    for gid in req.group_ids or []:
        if not mgr.buffer.known(gid):
            raise not_found(f"unknown group_id {gid!r}")
    await mgr.read_samples(req.sample_ids or [])
    named = _groups_of(mgr, req)
    # Background samples stop like any (with a snapshot when they are paused, the keep asked
    # for when they are aborted) and are no longer wanted there.
    scope: set[str] = set(mgr.background.sample_ids(None if req.all else named))
    _give_up(mgr, req, named)
    runs = _in_scope(mgr, req, named, scope)
    scope.update(r.sample.sample_id for r in runs)
    await mgr.stop_running(runs, req.keep)
    async with mgr.background.paused():
        groups = await mgr.buffer.read_bodies(list(dict.fromkeys(req.group_ids or [])))
        for g in groups.values():
            scope.update(s.sample_id for s in g.samples)
        scope.update(req.sample_ids or [])
        while True:
            _give_up(mgr, req, named)
            runs = _in_scope(mgr, req, named, scope)
            if runs:
                scope.update(r.sample.sample_id for r in runs)
                await mgr.stop_running(runs, req.keep)
                continue
            bodies = await mgr.buffer.read_bodies(sorted({_group(sid) for sid in scope}))
            _give_up(mgr, req, named)
            if not _in_scope(mgr, req, named, scope):  # nothing started during the read
                # Groups that left meanwhile (delivered, deleted) are not reported.
                return AbortResp(samples=_members(bodies, sorted(scope)))


def _groups_of(mgr: RolloutManager, req: AbortReq) -> set[str]:
    """The groups an abort names (a finished call's: those it left in the background)."""
    named = set(req.group_ids or []) | {_group(s) for s in req.sample_ids or []}
    if req.batch_id is not None:
        named |= mgr.background.handed_in_by(req.batch_id)
    return named


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


def _give_up(mgr: RolloutManager, req: AbortReq, named: set[str]) -> None:
    """Step 1 as the holder map says now: every call holding a named group gives it up (all
    of its groups, for `all` and its own batch), and the background forgets them."""
    for call in list(mgr.calls.values()):
        if req.all or req.batch_id == call.batch_id:
            call.give_up(None)
            continue
        mine = named & mgr.buffer.held_by(call.batch_id)
        if mine - call.given_up:
            call.give_up(mine)
    mgr.background.forget(None if req.all else named)


def _in_scope(
    mgr: RolloutManager, req: AbortReq, named: set[str], scope: set[str]
) -> list[Running]:
    """Step 2: what of its scope generates now."""
    return [
        r
        for sid, r in mgr.running.items()
        if req.all
        or sid in scope
        or (req.batch_id is not None and r.owner == req.batch_id)
        or (r.owner == BACKGROUND and r.sample.group_id in named)
    ]
