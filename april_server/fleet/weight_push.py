"""A weight push to the fleet: every reachable engine at once, new segments held meanwhile.

`FleetEngine` holds one `WeightPush` (`fleet.weights`) over its members. `update_weights` loads
new weights on every engine that is up (or on the ones named); new segments wait
(`FleetEngine.run_segment`, through `held`/`released`) until all have answered, and the fleet's
`version` changes only to one every engine in the pool reports. An engine left behind is
`stale` until a probe finds it level (a disk push is replayed to it: `last_update`). A
weight-update session over a group holds new segments from its begin to its end (`SessionGate`,
which the owner's weight session holds), and the group (`weight_group.py`, handed this part)
answers for itself (`answer_group_with`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

import httpx

from april_client.protocol import WeightGroupInfo
from april_server.fleet.remote import RemoteEngine
from april_server.wire.errors import ApiError

logger = logging.getLogger(__name__)
DISK = "/update_weights_from_disk"


class WeightPush:
    """The fleet's weights: their version, the pushes that change it, the segments they hold."""

    def __init__(self, members: dict[str, RemoteEngine]) -> None:
        """`members`: the fleet's engines by name, shared with it (it adds and drops them)."""
        self.members = members
        self.version: str | None = None  # the weights every engine in the pool runs
        self.last_update: dict[str, Any] | None = None  # replayed to engines that rejoin
        self.session_open = False  # a begin_weight_update ... end session keeps segments held
        self._open = asyncio.Event()  # closed while new segments are held
        self._open.set()
        self._update_lock = asyncio.Lock()
        # `GET /april/v1/weights/group`: the owner's weight-update group once there is one
        self._group_info: Callable[[], WeightGroupInfo] = self._no_group

    def answer_group_with(self, info: Callable[[], WeightGroupInfo]) -> None:
        """The weight-update group (`weight_group.py`) answers `group()` from now on."""
        self._group_info = info

    def group(self) -> WeightGroupInfo:
        return self._group_info()

    def updating(self) -> bool:
        """A push is in flight: versions are in motion, it settles every engine's state."""
        return self._update_lock.locked()

    def held(self) -> bool:
        """New segments wait (`released`) before they reach an engine."""
        return not self._open.is_set()

    async def released(self) -> None:
        await self._open.wait()

    async def update_weights(
        self, body: dict[str, Any], path: str = DISK, names: Collection[str] | None = None
    ) -> dict[str, Any]:
        """Load new weights (SGLang's route `path`) on every reachable engine, or on `names`;
        new segments wait meanwhile. Succeeds when every one of them reports the new version."""
        async with self._update_lock:
            self.hold_segments()
            try:
                return await self._update(body, path, names)
            finally:
                self.release_segments()

    def hold_segments(self, session: bool = False) -> None:
        """New segments wait (`FleetEngine.run_segment`) until `release_segments`; a weight-update
        session (`weight_group.py`) holds them from its begin to its end."""
        self.session_open = self.session_open or session
        self._open.clear()

    def release_segments(self, session: bool = False) -> None:
        if session:
            self.session_open = False
        if not self.session_open:
            self._open.set()

    def session_gate(self) -> SessionGate:
        """What an owner's weight session holds besides the root's segments."""
        return SessionGate(self)

    def _no_group(self) -> WeightGroupInfo:
        live = [m.info for m in self.members.values() if m.state != "down" and m.info]
        return WeightGroupInfo(
            ranks=sum(i.tp_size for i in live), weight_version=self.version or ""
        )

    async def _update(
        self, body: dict[str, Any], path: str, names: Collection[str] | None
    ) -> dict[str, Any]:
        targets = [
            m
            for m in self.members.values()
            if m.state != "down" and (names is None or m.name in names)
        ]
        if not targets:
            raise ApiError(503, "no_engine", "no engine is reachable to update")
        results = await asyncio.gather(
            *(m.update_weights(body, path) for m in targets), return_exceptions=True
        )
        failed = {
            m.name: str(r)
            for m, r in zip(targets, results, strict=True)
            if isinstance(r, BaseException)
        }
        await asyncio.gather(*(self.probe_quietly(m) for m in targets))
        versions = {m.name: m.weight_version() for m in targets if m.name not in failed}
        wanted = body.get("weight_version")
        new = str(wanted) if wanted is not None else next(iter(versions.values()), None)
        if new is not None and new in versions.values():
            self.version = new
            # Only a disk push can be replayed to an engine that rejoins; after a broadcast it
            # waits, held out, for the trainer's next push (`weight_group.py`).
            self.last_update = dict(body) if path == DISK else None
        for m in targets:
            if m.state == "down":
                continue  # a probe saw it die meanwhile: down until a probe says otherwise
            if m.name in failed or versions.get(m.name) != self.version:
                m.set_state("stale", failed.get(m.name, f"weights {versions.get(m.name)!r}"))
            elif m.state == "stale":
                m.set_state("healthy")
        ok = not failed and set(versions.values()) == {self.version}
        message = "every engine is at weight version " + repr(self.version)
        if not ok:
            message = f"weight update incomplete: failed {failed}, versions {versions}"
        return {
            "success": ok,
            "message": message,
            "weight_version": self.version,
            "engines": versions,
            "num_paused_requests": 0,
        }

    async def probe_quietly(self, m: RemoteEngine) -> None:
        try:
            await m.probe()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("april: engine %s: probe after update failed: %s", m.name, exc)


class SessionGate:
    """New segments wait while a weight-update session is open: between its begin and its end
    the engines are mid-update. The owner's weight session (`engine/weight_session.py`) cuts
    this at a session's begin and continues it at its end."""

    def __init__(self, push: WeightPush) -> None:
        self.push = push

    async def before_update(self) -> None:
        self.push.hold_segments(session=True)

    def after_update(self) -> None:
        self.push.release_segments(session=True)
