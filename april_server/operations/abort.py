"""`POST /april/v1/abort`: stop samples by batch, group, sample or all, and say where they are.

1. A call whose groups it names stops waiting for their answers (`give_up`); the background
   forgets them (they stay buffered, idle).
2. Everything in its scope that generates stops with the `keep` asked for (snapshot, tokens,
   drop); when it returns nothing in its scope is generating.
3. It answers the state of every sample in its scope. Idempotent: an abort naming a finished
   call is a no-op, not a 404.
"""

from __future__ import annotations

from april_client.protocol import AbortReq, AbortResp
from april_server.engine.segment_state import BACKGROUND
from april_server.runtime.manager import RolloutManager
from april_server.wire.errors import not_found


async def abort(mgr: RolloutManager, req: AbortReq) -> AbortResp:
    mgr.counters.abort_calls += 1
    scope: set[str] = set()  # sample ids whose state is returned
    if req.batch_id is not None:
        if req.batch_id not in mgr.calls and req.batch_id not in mgr.finished_batches:
            raise not_found(f"unknown batch_id {req.batch_id!r}")
    # Background samples stop like any (with a snapshot when they are paused, the keep
    # asked for when they are aborted) and are no longer wanted there.
    named = _groups_of(mgr, req)
    for call in list(mgr.calls.values()):  # stop waiting for these groups' answers
        if req.all or req.batch_id == call.batch_id:
            call.give_up(None)
        elif named & set(call.group_ids):
            call.give_up(named & set(call.group_ids))
    scope.update(mgr.background.sample_ids(None if req.all else named))
    mine = [
        r
        for r in mgr.running.values()
        if r.owner == BACKGROUND and (req.all or r.sample.group_id in named)
    ]
    await mgr.stop_running(mine, req.keep)
    async with mgr.background.paused():
        mgr.background.forget(None if req.all else named)
        return await _abort(mgr, req, scope)


def _groups_of(mgr: RolloutManager, req: AbortReq) -> set[str]:
    """The groups an abort names (a finished call's: those it left in the background)."""
    named = set(req.group_ids or []) | {s.rpartition("/")[0] for s in req.sample_ids or []}
    if req.batch_id is not None:
        named |= mgr.background.handed_in_by(req.batch_id)
    return named


async def _abort(mgr: RolloutManager, req: AbortReq, scope: set[str]) -> AbortResp:
    named = await mgr.buffer.read(list(dict.fromkeys(req.group_ids or [])))
    for g in named.values():
        scope.update(s.sample_id for s in g.samples)
    scope.update(await mgr.read_samples(req.sample_ids or []))
    runs = [
        r
        for sid, r in mgr.running.items()
        if req.all or sid in scope or (req.batch_id is not None and r.owner == req.batch_id)
    ]
    scope.update(r.sample.sample_id for r in runs)
    await mgr.stop_running(runs, req.keep)
    known = [sid for sid in sorted(scope) if mgr.buffer.known(sid.rpartition("/")[0])]
    now = await mgr.read_samples(known)
    return AbortResp(samples=[now[sid] for sid in known])
