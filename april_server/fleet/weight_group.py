"""An owner's weight-update group: a trainer broadcasts once to every engine.

SGLang's route set for a push over a torch.distributed group, as the owner answers it:
- `POST /init_weights_update_group`: the trainer is rank 0 (`rank_offset`: where the engines
  start, 1 for one trainer rank); every engine that is up joins with its own offset (engines in
  name order, each taking its TP size in ranks), so the trainer initialises one group of world
  size `rank_offset` + the fleet's ranks (`GET /april/v1/weights/group` says how many);
- `POST /begin_weight_update` ... `POST /update_weights_from_distributed` ...
  `POST /end_weight_update`: fanned out to the group's engines. The owner's running segments are
  cut at the version boundary for the session (they continue under the new weights after its
  end, like a disk push), and no new segment starts meanwhile;
- `POST /destroy_weights_update_group`: every engine in the group leaves it.

An engine that was down during a push, restarted, or joined later is not in the group: its
weights are older than the fleet's, so it stays `stale` (out of placement, no segment runs on
it) until it has the current version. It gets it from the trainer's next broadcast: the group
info lists it in `behind` and `in_sync` is false, the trainer (the TRL adapter does this before
each push) initialises a new group over every engine that is up and pushes; once the engine
reports the fleet's version it serves again. A disk push brings it level too. Nothing replays a
broadcast to it, since only the trainer holds the weights.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from april_client.protocol import WeightGroupInfo
from april_server.engine.weight_session import WeightGroup, WeightSession
from april_server.fleet.remote import RemoteEngine
from april_server.fleet.weight_push import WeightPush
from april_server.wire.errors import ApiError

logger = logging.getLogger(__name__)


def rank_offsets(engines: list[tuple[str, int]], first: int) -> dict[str, int]:
    """Each engine's first rank: in name order, each taking its TP size in ranks."""
    out, rank = {}, first
    for name, ranks in sorted(engines):
        out[name] = rank
        rank += ranks
    return out


class FleetWeights:
    def __init__(self, push: WeightPush, session: WeightSession) -> None:
        """`push`: the fleet's weight push (`FleetEngine.weights`), whose engines the group
        spans and whose version it pushes; `session`: the owner's weight session, which
        remembers the group, and cuts and holds the segments for a begin..end session (the
        same one a single server runs around SGLang's routes)."""
        self.push = push
        self.session = session
        push.answer_group_with(self.info)  # the fleet's `weight_group()` (`GET .../weights/group`)

    def live(self) -> list[RemoteEngine]:
        return [m for m in self.push.members.values() if m.state != "down" and m.info]

    def members(self) -> list[RemoteEngine]:
        """The group's engines that are still in it (a restart leaves a group)."""
        g = self.session.group
        if g is None:
            return []
        return [
            m
            for m in self.push.members.values()
            if m.name in g.rank_offsets and m.info is not None and m.info.weight_group == g.name
        ]

    def info(self) -> WeightGroupInfo:
        live = self.live()
        inside = {m.name for m in self.members() if m.state != "down"}
        behind = sorted(m.name for m in live if m.name not in inside)
        g = self.session.group
        lost = g is not None and any(n not in inside for n in g.rank_offsets)  # down or restarted
        return WeightGroupInfo(
            ranks=sum(m.info.tp_size for m in live if m.info is not None),
            weight_version=self.push.version or "",
            group=None if g is None else g.name,
            world_size=None if g is None else g.world_size,
            in_sync=g is not None and not behind and not lost,
            behind=behind,
        )

    # ---- the group ------------------------------------------------------------------------

    async def init(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        first = int(body.get("rank_offset", 1))
        live = self.live()
        ranks = sum(m.info.tp_size for m in live if m.info is not None)
        if not live:
            raise ApiError(503, "no_engine", "no engine is up to join a weight-update group")
        if int(body.get("world_size", -1)) != first + ranks:
            raise ApiError(
                400,
                "invalid_world_size",
                f"world_size must be {first + ranks}: rank_offset {first} + the {ranks} ranks of "
                f"the {len(live)} engines that are up (GET /april/v1/weights/group)",
            )
        offsets = rank_offsets([(m.name, m.info.tp_size) for m in live if m.info], first)
        by_name = {m.name: m for m in live}
        sends = [
            by_name[n].update_weights({**body, "rank_offset": off}, "/init_weights_update_group")
            for n, off in offsets.items()
        ]
        results = await asyncio.gather(*sends, return_exceptions=True)
        failed = {
            n: str(r) for n, r in zip(offsets, results, strict=True) if isinstance(r, Exception)
        }
        await asyncio.gather(*(self.push.probe_quietly(m) for m in live))
        if failed:
            self.session.left(name)
            # Those that joined leave the half-made group (best effort): the trainer's join
            # fails too, and a later init may reuse nothing of it.
            joined = [by_name[n] for n in offsets if n not in failed]
            leave = {"group_name": name}
            await asyncio.gather(
                *(m.update_weights(leave, "/destroy_weights_update_group") for m in joined),
                return_exceptions=True,
            )
            raise ApiError(502, "engine_failed", f"joining the group failed on {failed}")
        self.session.joined(WeightGroup(name, first + ranks, offsets))
        return {
            "success": True,
            "message": f"{len(offsets)} engines joined {name!r}",
            "rank_offsets": offsets,
        }

    async def destroy(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        inside = [m for m in self.members() if m.state != "down"]
        self.session.left(name)
        results = await asyncio.gather(
            *(m.update_weights(body, "/destroy_weights_update_group") for m in inside),
            return_exceptions=True,
        )
        await asyncio.gather(*(self.push.probe_quietly(m) for m in inside))
        failed = {
            m.name: str(r) for m, r in zip(inside, results, strict=True) if isinstance(r, Exception)
        }
        return {
            "success": not failed,
            "message": f"left by {len(inside) - len(failed)} engines",
            "failed": failed,
        }

    # ---- a push: begin, update, end ---------------------------------------------------------

    def _targets(self) -> list[str]:
        g = self.info()
        if self.session.group is None:
            raise ApiError(409, "no_weight_group", "no weight-update group: init one first")
        if not g.in_sync:
            raise ApiError(
                409,
                "weight_group_behind",
                f"engines {g.behind} are not in group {g.group!r} (restarted or joined later), "
                "or one of its engines is down: destroy it, init a new one over the engines that "
                "are up (GET /april/v1/weights/group) and push again",
            )
        return [m.name for m in self.members()]

    async def begin(self, body: dict[str, Any]) -> dict[str, Any]:
        names = self._targets()
        opening = not (self.session.open or self.session.beginning)

        async def send() -> dict[str, Any]:
            failed, began = await self._fan_out(names, "/begin_weight_update", body)
            if failed and opening:
                # A refused begin holds nothing (as on one server): the engines that began
                # leave their session again, and ours serve at once, rather than wait out the
                # session's time limit (a trainer whose begin failed never sends the end).
                await self._fan_out(began, "/end_weight_update", {})
            if failed:
                raise ApiError(502, "engine_failed", f"/begin_weight_update failed on {failed}")
            return {"success": True, "message": f"/begin_weight_update on {len(names)} engines"}

        return await self.session.begin(send, succeeded=lambda _: True, abort_all=False)

    async def update(self, body: dict[str, Any]) -> dict[str, Any]:
        names = self._targets()
        if not self.session.open:
            raise ApiError(
                400,
                "no_weight_session",
                "update_weights_from_distributed runs between /begin_weight_update and "
                "/end_weight_update (SGLang 0.5.23)",
            )
        if body.get("weight_version") is None:
            # As for a disk push: an engine restarted with its first weights must not
            # report the pushed version.
            body["weight_version"] = f"owner-{uuid.uuid4().hex[:12]}"
        return await self.push.update_weights(body, "/update_weights_from_distributed", names)

    async def end(self, body: dict[str, Any]) -> dict[str, Any]:
        names = [m.name for m in self.members() if m.state != "down"]
        return await self.session.end(lambda: self._each(names, "/end_weight_update", body))

    async def _each(self, names: list[str], path: str, body: dict[str, Any]) -> dict[str, Any]:
        failed, _ = await self._fan_out(names, path, body)
        if failed:
            raise ApiError(502, "engine_failed", f"{path} failed on {failed}")
        return {"success": True, "message": f"{path} on {len(names)} engines"}

    async def _fan_out(
        self, names: list[str], path: str, body: dict[str, Any]
    ) -> tuple[dict[str, str], list[str]]:
        """(engine -> why it failed, the engines that answered) for `path` sent to all."""
        ms = [self.push.members[n] for n in names]
        results = await asyncio.gather(
            *(m.update_weights(body, path) for m in ms), return_exceptions=True
        )
        failed = {
            m.name: str(r) for m, r in zip(ms, results, strict=True) if isinstance(r, Exception)
        }
        return failed, [m.name for m in ms if m.name not in failed]
