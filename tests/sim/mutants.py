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
- `ignores_own_bound`: a call starts its groups without its own `max_staleness` (a buffered
  sample whose newest segment is older than the call allows continues instead of restarting).
- `drop_before_restart`: a call's claim frees a member's snapshot before it restarts the
  member (an `await` where the restart is decided and recorded in one step): meanwhile an
  answer waiting for the group can start the member the bound should restart.
- `answer_into_winding_down`: an answer for a group whose call is winding down is written
  into the call's copy instead of waiting for the group to come back: the call may have
  persisted already, and the answer is lost as the call hands the group back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from april_client.protocol import InputResp
from april_server.calls.refill import Refill
from april_server.engine.segment_state import CallTally
from april_server.operations.inputs import PostInput
from april_server.rules import samples as sample_rules
from april_server.rules import turns as turn_rules
from april_server.runtime.background import OWNER as BACKGROUND
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


def _own_bound_ignored(real: Any) -> Any:
    def _start_group(self: Refill, gid: str) -> int:
        req = self.state.req
        bound, req.max_staleness = req.max_staleness, None
        try:
            started: int = real(self, gid)
        finally:
            req.max_staleness = bound
        return started

    return _start_group


async def _drop_then_restart(self: Background, groups: Any, tally: CallTally) -> None:
    """`restart_stale` as it was, the snapshot freed before each restart."""
    if not self.bounds:
        return
    for g in list(groups):
        bound = self.bounds.get(g.group_id)
        if bound is None:
            continue
        for s in g.samples:
            if self.segments.is_running(s.sample_id):
                continue
            if self._past_bound(s, bound):
                await self.segments.forget(s)  # the await, before the restart is recorded
                sample_rules.restart_for_staleness(s)
                self.planner.count_restart(s, tally)
                rested = self.resting.pop(g.group_id, None)
                if rested is not None:
                    self.wanted[g.group_id], self.handed_by[g.group_id] = rested


async def _take_into_winding_down(
    self: PostInput, sample_id: str, gid: str, ids: list[int], turn: int | None
) -> InputResp:
    """`PostInput._take` without the wait for a call that winds down."""
    while True:
        holder = await self._holder(gid, sample_id)
        if holder is None:
            return await self._answer_idle(sample_id, gid, ids, turn)
        call = self.calls.get(holder.owner)
        if call is not None:
            sample = self.buffer.claimed_sample(sample_id)
            self._check(sample, ids, turn)
            turn_rules.apply_answer(sample, ids)
            if call.turns.holds_for_input(sample):
                call.turns.continue_answered(sample)
            return InputResp(sample=sample, batch_id=call.state.batch_id)
        if holder.owner != BACKGROUND:
            return await self._answer_idle(sample_id, gid, ids, turn)
        async with self.background.paused():
            if await self._holder(gid, sample_id) is None:
                return await self._answer_idle(sample_id, gid, ids, turn)


MUTANTS: dict[str, tuple[type, str, Any]] = {
    "await_before_bounds": (Background, "restart_stale", _await_first),
    "no_staleness_restart": (Background, "restart_stale", lambda real: _no_restart),
    "fill_forgets_held": (Background, "_fill", _fill_forgetting),
    "take_over_keeps_quiet": (Refill, "take_over_background", _quiet_take_over),
    "ignores_own_bound": (Refill, "_start_group", _own_bound_ignored),
    "drop_before_restart": (Background, "restart_stale", lambda real: _drop_then_restart),
    "answer_into_winding_down": (PostInput, "_take", lambda real: _take_into_winding_down),
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
