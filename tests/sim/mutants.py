"""Known bugs put back on purpose (`python -m tests.sim --mutant NAME`), to show that the
simulator's checks fail when the server is wrong: a check that cannot fail proves nothing.

- `no_staleness_restart`: a call's claim no longer restarts members past the background's
  `max_staleness` (the bound is lost; delivered staler than it allows).
- `fill_forgets_held`: the background's round forgets a wanted group that is not idle, as it
  did before the holder map was its one word, so an answer holding the group makes the
  background drop it for good.
- `await_before_bounds`: a call's claim yields to the loop before it applies the
  background's bound (as the staleness restart did when it awaited a snapshot's release
  first), so an answer waiting for the group can start a member the bound should restart.
- `take_over_keeps_quiet`: a streamed agent call that takes over a background group whose
  last segments reached turn stops just before the hand-over does not announce its awaiting
  members, so it waits for good for answers nobody was asked for (a wedge).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from april_server.calls.refill import Refill
from april_server.runtime.background import Background


async def _no_restart(self: Background, groups: Any, tally: Any) -> None:
    return None


def _fill_forgetting(real: Any) -> Any:
    async def fill(self: Background) -> list[str]:
        for gid in [g for g in self.wanted if g not in self.buffer.idle]:
            self.forget([gid], gone=True)
        result: list[str] = await real(self)
        return result

    return fill


def _await_first(real: Any) -> Any:
    async def restart_stale(self: Background, groups: Any, tally: Any) -> None:
        groups = list(groups)
        await asyncio.sleep(0)
        await real(self, groups, tally)

    return restart_stale


def _quiet_take_over(real: Any) -> Any:
    async def take_over_background(self: Refill, limit: int, sample_target: int) -> None:
        announce = self.turns.announce_awaiting
        self.turns.announce_awaiting = lambda gid: None  # type: ignore[method-assign]
        try:
            await real(self, limit, sample_target)
        finally:
            self.turns.announce_awaiting = announce  # type: ignore[method-assign]

    return take_over_background


MUTANTS: dict[str, tuple[type, str, Any]] = {
    "await_before_bounds": (Background, "restart_stale", _await_first),
    "no_staleness_restart": (Background, "restart_stale", lambda real: _no_restart),
    "fill_forgets_held": (Background, "_fill", _fill_forgetting),
    "take_over_keeps_quiet": (Refill, "take_over_background", _quiet_take_over),
}


@contextlib.contextmanager
def mutant(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    cls, attr, make = MUTANTS[name]
    real = getattr(cls, attr)
    setattr(cls, attr, make(real))
    try:
        yield
    finally:
        setattr(cls, attr, real)
