"""What a weight push does to our segments, on one server and on an owner over its engines.

A push (`update_weights_from_*`) cuts our running segments at the version boundary before it
runs and lets them continue after it (`push`): SGLang's update takes a writer lock that waits
for every running request, so without the cut a push would wait for our longest straggler.
A weight-update session (`/begin_weight_update` ... `/end_weight_update`, which SGLang 0.5.23
requires around `update_weights_from_distributed`) holds them cut from its begin to its end
(`begin`, `end`): between its messages the model is mid-update (a trainer may send the weights
in several buckets), so nothing of ours may generate then, and the pushes inside it need no cut
of their own. A session never ended gives the segments back after `SESSION_LIMIT_S`, so a
trainer that died mid-push cannot stall the server for good. The session also remembers the
weight-update group the engine (or the owner's engines) joined last (`group`).

One server: `door/weight_hooks.py` wraps SGLang's routes around this. An owner: its routes
(`fleet/gateway.py`, `fleet/weight_group.py`) call it around the fan-out to its engines. Who
is cut is the root's weight cut (`engine/weight_cut.py`), handed over once the root is built
(`cut_by`); before that nothing of ours runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

logger = logging.getLogger(__name__)

SESSION_LIMIT_S = 300.0  # a session nobody ended gives the segments back after this
T = TypeVar("T")


class UpdateListener(Protocol):
    """What a weight push cuts: `before_update` ends its segments at the version boundary,
    `after_update` lets them continue under the new weights."""

    async def before_update(self) -> None: ...

    def after_update(self) -> None: ...


@dataclass
class WeightGroup:
    """A weight-update group (torch.distributed) the engines joined: its name, world size and,
    on an owner, each engine's first rank."""

    name: str
    world_size: int
    rank_offsets: dict[str, int] = field(default_factory=dict)


class WeightSession:
    def __init__(
        self, held_during_session: UpdateListener | None = None, limit_s: float = SESSION_LIMIT_S
    ) -> None:
        """`held_during_session`: cut at a session's begin and continued at its end besides
        the root's segments (an owner gates every new segment on its engines this way: they
        are mid-update between the two)."""
        self.held_during_session = held_during_session
        self.limit_s = limit_s
        self.group: WeightGroup | None = None  # the group joined last (None: none, or left)
        self.open = False  # between a begin that succeeded and its end
        self.beginning = False  # a begin waits for its answer: a second one cuts nothing
        self.held: list[UpdateListener] = []  # what the open session holds cut
        self._cut: UpdateListener | None = None
        self._watchdog: asyncio.Task[None] | None = None

    def cut_by(self, listener: UpdateListener) -> None:
        """The root's weight cut, handed over when the root is built (`root/holder.py`)."""
        self._cut = listener

    async def _cut_now(self, abort_all: bool, session: bool) -> list[UpdateListener]:
        """Cut what a push must not wait for; a caller that aborts everything gets exactly
        that instead (SGLang's own abort ends our segments, they are not continued)."""
        if abort_all:
            return []
        extra = [self.held_during_session] if session else []
        ready = [x for x in (*extra, self._cut) if x is not None]
        for x in ready:
            await x.before_update()
        return ready

    @asynccontextmanager
    async def push(self, abort_all: bool) -> AsyncIterator[None]:
        """Around one weight update: our segments end before it and continue after it. Inside
        an open session they are held already."""
        if self.open:
            yield
            return
        ready: list[UpdateListener] = []
        try:
            ready = await self._cut_now(abort_all, session=False)
            yield
        finally:
            if self.open:  # a session began meanwhile: its end continues them, not this push
                self.held += ready
            else:
                for x in ready:
                    x.after_update()

    async def begin(
        self, send: Callable[[], Awaitable[T]], succeeded: Callable[[T], bool], abort_all: bool
    ) -> T:
        """A session's begin: cut, then `send` it (to SGLang, or to every engine); the session
        is open if `succeeded` says so. A refused or failed begin holds nothing. A second begin
        (the engines refuse it) neither cuts nor lets go: the first one's session holds."""
        if self.open or self.beginning:
            return await send()
        self.beginning = True
        opened = False
        ready: list[UpdateListener] = []
        try:
            ready = await self._cut_now(abort_all, session=True)
            result = await send()
            opened = succeeded(result)
            return result
        finally:
            self.beginning = False
            if opened:
                self.open, self.held = True, self.held + ready
                self._watchdog = asyncio.get_running_loop().create_task(self._expire())
            else:
                for x in ready:
                    x.after_update()

    async def end(self, send: Callable[[], Awaitable[T]]) -> T:
        """A session's end: ended or refused, the session is over for our segments."""
        try:
            return await send()
        finally:
            self.release()

    def release(self) -> None:
        """Give back what the session holds (at its end, or when it expires)."""
        held, self.held, self.open = self.held, [], False
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        self._watchdog = None
        for x in held:
            x.after_update()

    async def _expire(self) -> None:
        await asyncio.sleep(self.limit_s)
        logger.warning(
            "april: a weight-update session began %.0f s ago and was never ended: our segments "
            "continue",
            self.limit_s,
        )
        self.release()

    def joined(self, group: WeightGroup) -> None:
        self.group = group

    def left(self, name: str) -> None:
        if self.group is not None and self.group.name == name:
            self.group = None
