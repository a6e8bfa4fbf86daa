"""`DELETE /april/v1/partials/{group_id}`: a buffered group leaves the server (durably, with
its KV snapshots); 409 `group_busy` while someone else holds it, 404 when unknown."""

from __future__ import annotations

import uuid

from april_client.protocol import DeleteResp
from april_server.runtime.manager import RolloutManager, run_to_end


async def delete(mgr: RolloutManager, group_id: str) -> DeleteResp:
    async with mgr.background.paused():
        return await run_to_end(_delete(mgr, group_id))


async def _delete(mgr: RolloutManager, group_id: str) -> DeleteResp:
    owner = f"delete-{uuid.uuid4().hex[:12]}"
    try:
        await mgr.buffer.resolve(group_id)  # a claim in flight: wait it out, then 409
        (group,) = await mgr.buffer.claim([group_id], owner, busy_code="group_busy")
        await mgr.persist([], [group_id])
        # Only now is it gone: a delete refused (409, 404) leaves the background's view alone.
        mgr.background.forget([group_id], gone=True)
    finally:
        mgr.release(owner)
    for s in group.samples:
        await mgr.segments.forget(s)
    return DeleteResp(group_id=group_id, deleted=True)
