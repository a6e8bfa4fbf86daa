"""`DELETE /april/v1/partials/{group_id}`: a buffered group leaves the server (durably, with
its KV snapshots); 409 `group_busy` while someone else holds it, 404 when unknown."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from april_client.protocol import DeleteResp
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.segment_runner import SegmentRunner
from april_server.runtime.background import Background
from april_server.runtime.persister import Persister
from april_server.runtime.run_to_end import run_to_end


@dataclass(eq=False)
class Delete:
    buffer: PartialBuffer
    background: Background
    segments: SegmentRunner  # frees the group's KV snapshots
    persister: Persister

    async def __call__(self, group_id: str) -> DeleteResp:
        async with self.background.paused():
            return await run_to_end(self._delete(group_id))

    async def _delete(self, group_id: str) -> DeleteResp:
        buffer = self.buffer
        owner = f"delete-{uuid.uuid4().hex[:12]}"
        try:
            await buffer.resolve(group_id)  # a claim in flight: wait it out, then 409
            (group,) = await buffer.claim([group_id], owner, busy_code="group_busy")
            await self.persister.persist([], [group_id])
            # Only now is it gone: a delete refused (409, 404) leaves the background alone.
            self.background.forget([group_id], gone=True)
        finally:
            buffer.release(owner)
        for s in group.samples:
            await self.segments.forget(s)
        return DeleteResp(group_id=group_id, deleted=True)
