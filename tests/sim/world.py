"""One simulated run: the real core (manager, calls, background, operations, buffer, segment
runner, the store on in-memory SQLite) on the simulated engine, driven by random clients.

A run is a few rounds; each round starts a burst of concurrent client operations at random
virtual times and waits until all have ended (answers that come late included): a quiet point,
where the background's groups are checked against the ledger. After the last round it drains
(abort all, the background settles) and checks that nothing is lost, running, or held.
Integrity (`RolloutManager.check_integrity`) is checked after every client operation and,
at random, between callbacks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from april_client.protocol import (
    AbortReq,
)
from april_server.rules import samples, turns
from tests.sim.call_clients import CallClients
from tests.sim.ledger import require
from tests.sim.operation_clients import OperationClients
from tests.unit.idle import idle_bodies


class World(CallClients, OperationClients):
    OPS: list[tuple[str, float]] = [
        ("op_call", 5),
        ("op_groups", 2),
        ("op_answer", 3),
        ("op_abort", 1.5),
        ("op_delete", 1),
        ("op_resume", 1),
        ("op_push", 2),
        ("op_same_id", 0.3),
        ("op_engine_errors", 0.3),
        ("op_retry_grows", 0.5),
        ("op_answer_beside_call", 1),
        ("op_agent_under_push", 1),
    ]

    async def client(self, name: str, at: float) -> None:
        await asyncio.sleep(at)
        op: Callable[[], Awaitable[None]] = getattr(self, name)
        self.inflight += 1
        try:
            await op()
        finally:
            self.inflight -= 1

    # ---- a run -------------------------------------------------------------------------------

    async def main(self, rounds: int) -> None:
        rng = self.rng
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        for _ in range(rounds):
            burst = rng.choices(names, weights, k=rng.randint(2, 6))
            await asyncio.gather(*(self.client(n, rng.uniform(0, 0.05)) for n in burst))
            while self.late:
                await self.late.pop()
            await self.settle_abandoned()
            self.quiet_check()
        await self.drain()

    def quiet_check(self) -> None:
        """No client operation in flight: every group the background was handed (and nobody
        aborted, delivered, dropped or deleted since) is still wanted there, unless finished."""
        self.check()
        bg, idle = self.mgr.background, self.mgr.buffer.idle
        for gid in sorted(self.ledger.background):
            if gid in bg.wanted:
                continue
            e = idle.get(gid)
            finished = e is not None and e.unfinished == 0
            g = self.mgr.buffer.claimed.get(gid)
            finished = finished or (g is not None and samples.group_finished(g))
            require(finished, f"the background forgot {gid} (nobody aborted or took it)")

    async def drain(self) -> None:
        """Answer what waits, abort everything, let the background settle; then nothing may be
        running, held, or lost."""
        for sid, turn in self.pending:
            await self.answer(sid, turn)
        self.pending.clear()
        await self.settle_abandoned()
        await self.mgr.abort(AbortReq(all=True, keep="tokens"))
        self.ledger.background.clear()
        for _ in range(100):
            if self.mgr.background._task is None and not self.mgr.segments.running:
                break
            await asyncio.sleep(0.05)
        mgr, led = self.mgr, self.ledger
        require(
            not mgr.segments.running,
            f"still running after the drain: {sorted(mgr.segments.running)}",
        )
        require(not mgr.calls, f"calls left: {sorted(mgr.calls)}")
        require(not mgr.buffer.holders, f"still held: {dict(mgr.buffer.holders)}")
        require(not mgr.post_input.locks, f"answers left waiting: {sorted(mgr.post_input.locks)}")
        self.check()
        buffered = {e.group_id for e in mgr.buffer.idle.oldest()}
        gone = set(led.delivered) | led.dropped | led.deleted
        lost = led.acked - gone - buffered
        require(not lost, f"lost: {sorted(lost)}")
        twice = gone & buffered
        require(not (set(led.delivered) & buffered), f"delivered and still buffered: {twice}")
        for g in [*idle_bodies(mgr.buffer), *led.bodies]:
            for s in g.samples:
                led.check_sample(s)
                if turns.awaiting(s):
                    require(g.group_id in buffered, f"{s.sample_id} awaits outside the buffer")
