"""`POST /april/v1/groups`: hand groups in without waiting (prefetch).

The trainer hands in the next step's prompts before it trains: they are validated exactly like
`/rollouts` groups (nothing is added on bad input), made durable in the buffer, and with
`start: background` handed to the background (`background.py`), which generates them while no
call runs. A later call serves them like any buffered group. `request_id` makes it idempotent.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import msgspec

from april_client.protocol import Group, GroupsReq, GroupsResp
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.buffer.store import BufferStore
from april_server.calls.new_groups import new_groups
from april_server.engine.base import BaseEngine
from april_server.rules import samples as sample_rules
from april_server.runtime.background import Background
from april_server.runtime.persister import Persister
from april_server.runtime.run_to_end import run_to_end
from april_server.wire.errors import bad_request, conflict
from april_server.wire.ids import check_id

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(GroupsResp)
# `/groups` remembers its answers apart from `/rollouts`' ("/" is in no request_id): a trainer
# may well name its hand-in and its call of one step alike.
KEY_PREFIX = "groups/"


@dataclass(eq=False)
class AddGroups:
    engine: BaseEngine  # checks the prompts and params, like a call's
    store: BufferStore  # a `request_id`'s earlier answer
    buffer: PartialBuffer
    background: Background
    persister: Persister

    async def __call__(self, req: GroupsReq) -> GroupsResp:
        buffer = self.buffer
        key = None
        if req.request_id is not None:
            check_id("request_id", req.request_id)
            key = KEY_PREFIX + req.request_id
            stored = await self.store.load_call(key)
            if stored is not None and stored.startswith(b"{"):
                return _dec.decode(stored)
        if req.max_staleness is not None and req.max_staleness < 0:
            raise bad_request("invalid_request", "max_staleness must be >= 0 or null")
        if not req.groups:
            raise bad_request("invalid_request", "groups is empty")
        built = await new_groups(
            self.engine,
            buffer,
            req.groups,
            turns=req.turns,
            routing=req.return_routed_experts,
            mask=req.return_sampling_mask,
        )
        for g in built:  # the validation yielded: a call may have sent the same id meanwhile
            if buffer.known(g.group_id):
                raise conflict("group_exists", f"group {g.group_id!r} is already known")
        ids = [g.group_id for g in built]
        background = req.start == "background"
        started = sum(_unfinished(g) for g in built) if background else 0
        resp = GroupsResp(group_ids=ids, started_samples=started)
        call = None if key is None else (key, _enc.encode(resp))
        owner = f"groups-{uuid.uuid4().hex[:12]}"
        buffer.adopt(built, owner)
        committed = False

        async def commit() -> None:
            nonlocal committed
            await self.persister.persist(built, [], call)
            committed = True

        try:  # durable before acknowledged, even if the caller goes away meanwhile
            await run_to_end(commit())
        finally:
            buffer.release(owner)
            # Handed to the background once durable, even if the caller went away meanwhile:
            # its retry is answered from the stored response, which says they were handed in.
            if background and committed:
                self.background.add(ids, req.max_staleness)
        return resp


def _unfinished(g: Group) -> int:
    return sum(
        1
        for s in g.samples
        if not sample_rules.is_finished(s) and sample_rules.remaining_budget(s) > 0
    )
