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
import random
from collections.abc import Awaitable, Callable

from april_client.protocol import (
    AbortReq,
)
from april_server.rules import samples, turns
from tests.sim.base import group_of
from tests.sim.call_clients import CallClients
from tests.sim.feature_clients import FEATURE_OPS
from tests.sim.ledger import require
from tests.sim.operation_clients import OperationClients
from tests.sim.restart import build_core, restarted_engine
from tests.sim.store import SimDb, StoreFaults
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
        ops = [*self.OPS, *FEATURE_OPS] if self.plan.on else self.OPS
        names = [n for n, _ in ops]
        weights = [w for _, w in ops]
        while self.round < rounds:
            self.round += 1
            burst = rng.choices(names, weights, k=rng.randint(2, 6))
            await asyncio.gather(*(self.client(n, rng.uniform(0, 0.05)) for n in burst))
            while self.late:
                await self.late.pop()
            await self.settle_abandoned()
            self.quiet_check()
        await self.drain()

    # ---- a crash and a restart (restart.py) ---------------------------------------------------

    def crashed(self) -> None:
        """The process died (no loop runs now): what the clients had in flight is uncertain."""
        at, led = self.at_crash, self.ledger
        assert at is not None
        self.trace.append(f"{'':9} process died (version {at.version})")
        standing = led.acked - set(led.delivered) - led.dropped - led.deleted
        led.maybe_gone |= (standing - at.known) | (standing & at.removers)
        led.not_durable(at.live_calls)
        for sid, ids in at.answering:
            led.answer_taken(sid, ids, False, None)
        for req, gids, start_version in at.calling:
            if req.request_id is not None:  # settled from the store, like an abandoned call
                self.abandoned.append((req, gids, start_version))
        self.answering.clear()
        self.calling.clear()
        # The background's wants and bounds live in memory only: a restart forgets them.
        led.background.clear()
        led.bounds.clear()
        self.stranded.clear()
        self.late.clear()
        self.inflight = self.aborting = led.dropping = 0

    async def restarted(self, rounds: int) -> None:
        """A new process on the store the dead one left: what was acknowledged is there, what
        left the server did not come back; then the rounds go on."""
        self.eng = restarted_engine(self.eng, random.Random(self.rng.random()))
        self.mgr = build_core(self.eng, self.plan.options)
        self.store = self.mgr.store
        self.note("process restarted")
        led, buf = self.ledger, self.mgr.buffer
        present = {e.group_id for e in buf.idle.oldest()}
        standing = led.acked - set(led.delivered) - led.dropped - led.deleted - led.maybe_gone
        require(not standing - present, f"lost by the crash: {sorted(standing - present)}")
        back = (set(led.delivered) | led.dropped | led.deleted) & present
        require(not back, f"delivered, dropped or deleted, back after the crash: {sorted(back)}")
        for g in idle_bodies(buf):
            for s in g.samples:
                led.check_sample(s)
        self.check()
        self.after_crash = True  # what the dead process's clients left: answered before it died
        await self.settle_abandoned()
        self.after_crash = False
        await self.main(rounds)

    # ---- checks --------------------------------------------------------------------------------

    def quiet_check(self) -> None:
        """No client operation in flight: every group the background was handed (and nobody
        aborted, delivered, dropped or deleted since) is still wanted there, unless finished;
        no group reported dropped or deleted is held or buffered."""
        self.check()
        led, buf = self.ledger, self.mgr.buffer
        back = {g for g in led.dropped | led.deleted if buf.known(g)}
        require(not back, f"dropped or deleted, yet held or buffered: {sorted(back)}")
        bg, idle = self.mgr.background, self.mgr.buffer.idle
        for gid in sorted(self.ledger.background):
            if gid in bg.wanted:
                continue
            e = idle.get(gid)
            finished = e is not None and e.unfinished == 0
            g = self.mgr.buffer.claimed.get(gid)
            finished = finished or (g is not None and samples.group_finished(g))
            require(finished, f"the background forgot {gid} (nobody aborted or took it)")
        # Nothing holds the background off, no round runs: then nothing it wants may wait
        # runnable in the buffer (it would never start: nobody kicks an idle background).
        # After a round that failed (the store failed under it) it waits for the next kick.
        if bg._task is None and not bg._holds and not self.mgr.calls:
            stuck = [g for g in bg.wanted if self.left_runnable(g) and g not in self.stranded]
            require(not stuck, f"the background wants {sorted(stuck)} runnable, runs nothing")

    def left_runnable(self, gid: str) -> bool:
        """Idle with a member that can run, and not left there by an engine error."""
        buf = self.mgr.buffer
        e = buf.idle.get(gid)
        if buf.owner_of(gid) is not None or e is None or not e.runnable:
            return False
        return not any(self.eng.failed_last(f"{gid}/{i}") for i in range(e.num_samples))

    def heal(self) -> None:
        """The faults stop (the drain judges where they left the server): the store and the
        engine fail no more, a stale engine is level again."""
        SimDb.faults = StoreFaults(passive=True)
        self.eng.faults.part_fail_p = 0.0
        self.eng.stale.clear()

    async def background_progress(self) -> None:
        """Left alone, the background runs every group it still wants to its end or to a
        turn stop: none is wanted yet stuck (held, or idle and runnable)."""
        bg, buf = self.mgr.background, self.mgr.buffer
        for _ in range(400):  # abandoned calls may still wind down: then the background runs
            if bg._task is None and not bg._holds and not self.mgr.calls:
                break
            await asyncio.sleep(0.05)
        if self.stranded:  # after a failed round, the next call would kick it: so do we
            bg.kick()
            for _ in range(400):
                if bg._task is None:
                    break
                await asyncio.sleep(0.05)
        for gid in sorted(self.ledger.background):
            e = buf.idle.get(gid)
            require(
                e is not None and buf.owner_of(gid) is None and not self.left_runnable(gid),
                f"the background made no progress with {gid} (held by {buf.owner_of(gid)}, "
                f"{'gone' if e is None else f'{e.runnable} members runnable'})",
            )

    async def drain(self) -> None:
        """Answer what waits, abort everything, let the background settle; then nothing may be
        running, held, or lost."""
        if self.plan.on:
            self.heal()
            await self.background_progress()
        for sid, turn in self.pending:
            await self.answer(sid, turn)
        self.pending.clear()
        await self.settle_abandoned()
        await self.mgr.abort(AbortReq(all=True, keep="tokens"))
        self.ledger.background.clear()
        mgr = self.mgr
        for _ in range(100):  # work whose client went away still runs to its end
            if mgr.background._task is None and not mgr.segments.running:
                if not self.plan.on or not (mgr.buffer.holders or mgr.post_input.locks):
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
        lost = led.acked - gone - buffered - led.maybe_gone
        require(not lost, f"lost: {sorted(lost)}")
        twice = gone & buffered
        require(not (set(led.delivered) & buffered), f"delivered and still buffered: {twice}")
        idle = idle_bodies(mgr.buffer)
        for g in [*idle, *led.bodies]:
            for s in g.samples:
                led.check_sample(s)
                if turns.awaiting(s):
                    require(g.group_id in buffered, f"{s.sample_id} awaits outside the buffer")
        # Every KV snapshot the engine holds is one a buffered sample refers to, and every one
        # a buffered sample refers to is held (the snapshot sweep is off: nothing else frees).
        referred = {
            (slot, s.sample_id)
            for g in idle
            for s in g.samples
            if (slot := mgr.places.of(s)) is not None
        }
        held = self.eng.snapshots()
        disk = SimDb.disk
        failed = set() if disk is None else disk.failed_groups  # the sweep's (`store.Disk`)
        leaked = {(slot, key) for slot, key in held - referred if group_of(key) not in failed}
        require(not leaked, f"snapshots nobody refers to: {sorted(leaked)}")
        gone = {(slot, key) for slot, key in referred - held if group_of(key) not in failed}
        require(not gone, f"snapshots referred to, not held: {sorted(gone)}")
