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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

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


MUTANTS = {
    "await_before_bounds": ("restart_stale", _await_first),
    "no_staleness_restart": ("restart_stale", lambda real: _no_restart),
    "fill_forgets_held": ("_fill", _fill_forgetting),
}


@contextlib.contextmanager
def mutant(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    attr, make = MUTANTS[name]
    real = getattr(Background, attr)
    setattr(Background, attr, make(real))
    try:
        yield
    finally:
        setattr(Background, attr, real)
