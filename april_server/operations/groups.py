"""`POST /april/v1/groups`: hand groups in without waiting (prefetch, issue #19).

The trainer hands in the next step's prompts before it trains: they are validated exactly like
`/rollouts` groups (nothing is added on bad input), made durable in the buffer, and with
`start: background` handed to the background (`background.py`), which generates them while no
call runs. A later call serves them like any buffered group. `request_id` makes it idempotent.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import msgspec

from april_client.protocol import Group, GroupsReq, GroupsResp
from april_server.calls.rollout import new_groups
from april_server.rules import samples as S
from april_server.runtime.manager import run_to_end
from april_server.wire.errors import bad_request, conflict
from april_server.wire.ids import check_id

if TYPE_CHECKING:
    from april_server.runtime.manager import RolloutManager

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(GroupsResp)
# `/groups` remembers its answers apart from `/rollouts`' ("/" is in no request_id): a trainer
# may well name its hand-in and its call of one step alike.
KEY_PREFIX = "groups/"


async def add_groups(mgr: RolloutManager, req: GroupsReq) -> GroupsResp:
    key = None
    if req.request_id is not None:
        check_id("request_id", req.request_id)
        key = KEY_PREFIX + req.request_id
        stored = await mgr.store.load_call(key)
        if stored is not None and stored.startswith(b"{"):
            return _dec.decode(stored)
    if req.max_staleness is not None and req.max_staleness < 0:
        raise bad_request("invalid_request", "max_staleness must be >= 0 or null")
    if not req.groups:
        raise bad_request("invalid_request", "groups is empty")
    built = await new_groups(mgr, req.groups, turns=req.turns, routing=req.return_routed_experts)
    for g in built:  # the validation yielded: a call may have sent the same id meanwhile
        if mgr.buffer.known(g.group_id):
            raise conflict("group_exists", f"group {g.group_id!r} is already known")
    ids = [g.group_id for g in built]
    background = req.start == "background"
    started = sum(_unfinished(g) for g in built) if background else 0
    resp = GroupsResp(group_ids=ids, started_samples=started)
    call = None if key is None else (key, _enc.encode(resp))
    owner = f"groups-{uuid.uuid4().hex[:12]}"
    mgr.buffer.adopt(built, owner)
    try:  # durable before acknowledged, even if the caller goes away meanwhile
        await run_to_end(mgr.persist(built, [], call))
    finally:
        mgr.release(owner)
    if background:
        mgr.background.add(ids, req.max_staleness)
    return resp


def _unfinished(g: Group) -> int:
    return sum(1 for s in g.samples if not S.is_finished(s) and S.remaining_budget(s) > 0)
