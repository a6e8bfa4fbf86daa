"""Simulated clients of the other routes: answers, `/groups`, aborts, deletes, resumes, weight
pushes and windows of engine errors."""

from __future__ import annotations

import asyncio

from april_client.protocol import (
    AbortReq,
    GroupsReq,
    InputReq,
    ResumeReq,
)
from april_server.wire.errors import ApiError
from tests.sim.base import KEEPS, WorldBase, group_of
from tests.sim.ledger import require


class OperationClients(WorldBase):
    async def abort_named(self, gid: str) -> None:
        req = AbortReq(group_ids=[gid], keep=self.rng.choice(KEEPS))
        await self.aborted(req, {gid})

    async def answer(self, sid: str, turn: int, twice: bool = False, delay: bool = False) -> None:
        if delay:
            await asyncio.sleep(self.rng.uniform(0, 0.01 if self.rng.random() < 0.5 else 0.1))
        text, ids = self.answer_text(sid, turn)
        if text is None:
            ids = [(len(sid) + turn) % 60 + 1, turn]
        body = InputReq(text=text, turn=turn) if text else InputReq(append_ids=ids, turn=turn)
        gid = group_of(sid)
        self.answer_seq += 1
        key = self.answer_seq
        self.answering[key] = (sid, ids)  # taken or not, if the process dies meanwhile
        try:
            resp = await self.mgr.post_input(sid, body)
        except ApiError as exc:
            self.note(f"answer {sid} turn {turn}: {exc.code}")
            self.allowed("answer", exc, [gid])
            return
        except asyncio.CancelledError:  # its client went away: taken or not, it cannot know
            self.note(f"answer {sid} turn {turn}: abandoned")
            self.ledger.answer_taken(sid, ids, False, None)
            raise
        except OSError as exc:  # not made durable: the answer was not taken
            if not self.injected(f"answer {sid} turn {turn}", exc):
                raise
            return
        finally:
            self.answering.pop(key, None)
        self.note(f"answer {sid} turn {turn}: taken")
        # Held as it answers, unless a staleness restart of its continuation forgot it already.
        held = ids in [a.ids for a in resp.sample.appended]
        restarts = resp.sample.staleness_restarts if held else -1
        self.ledger.answer_taken(sid, ids, True, resp.batch_id, restarts)
        if twice:
            try:
                await self.mgr.post_input(sid, body)
            except ApiError as exc:
                # Taken already (or the group left, or another operation holds it now).
                require(exc.code in ("not_awaiting", "not_found", "group_busy"), f"second: {exc}")
                self.allowed("answer", exc, [gid])
            except OSError as exc:  # the store failed before it could look
                if not self.injected(f"answer {sid} turn {turn} again", exc):
                    raise
            else:
                raise AssertionError(f"{sid} took a second answer for turn {turn}")

    async def op_answer(self) -> None:
        """Answers that were held back, now, often while a call claims their group."""
        tasks = []
        while self.pending and (not tasks or self.rng.random() < 0.5):
            sid, turn = self.pending.pop(self.rng.randrange(len(self.pending)))
            tasks.append(self.answer(sid, turn, delay=self.rng.random() < 0.5))
        await asyncio.gather(*tasks)

    async def op_groups(self) -> None:
        rng = self.rng
        agent = rng.random() < 0.35
        gids = [self.fresh("p") for _ in range(rng.randint(1, 3))]
        req = GroupsReq(
            groups=[self.spec(g, agent) for g in gids],
            start=rng.choice(["background", "background", "idle"]),
            max_staleness=rng.choice([None, 0, 1, 2]),
            request_id=self.fresh("q") if rng.random() < 0.3 else None,
        )
        for attempt in range(2 if req.request_id and rng.random() < 0.5 else 1):
            label = f"groups {req.request_id or ''} {gids} {req.start} try {attempt}"
            try:
                resp = await self.mgr.add_groups(req)
            except ApiError as exc:
                self.note(f"{label}: {exc.code}")
                self.allowed("groups", exc, gids)
                return
            except OSError as exc:
                if not self.injected(label, exc):
                    raise
                return
            self.note(f"{label}: ok")
            require(resp.group_ids == gids, f"{label}: answered {resp.group_ids}")
            for gid in gids:
                self.ledger.create(gid, req.request_id or f"groups-{gids}")
                if req.start == "background" and attempt == 0:
                    self.ledger.background.add(gid)
                    self.ledger.handed_by.pop(gid, None)
                    self.ledger.bound(gid, req.max_staleness)
            self.check()

    async def op_abort(self) -> None:
        rng = self.rng
        kind = rng.choice(["all", "batch", "group", "group", "sample"])
        keep = rng.choice(KEEPS)
        known = self.known_groups()
        req = AbortReq(all=True, keep=keep)
        if kind == "batch" and self.batches:
            req = AbortReq(batch_id=rng.choice(self.batches), keep=keep)
        elif kind == "group" and known:
            req = AbortReq(
                group_ids=rng.sample(known, min(len(known), rng.randint(1, 2))), keep=keep
            )
        elif kind == "sample" and known:
            req = AbortReq(sample_ids=[f"{rng.choice(known)}/0"], keep=keep)
        named = set(req.group_ids or []) | {group_of(s) for s in req.sample_ids or []}
        await self.aborted(req, named)

    async def aborted(self, req: AbortReq, named: set[str]) -> None:
        led, keep = self.ledger, req.keep
        label = f"abort all={req.all} batch={req.batch_id} named={sorted(named)} keep={keep}"
        self.note(f"{label} starts")
        self.aborts += 1
        if keep == "drop":  # it resets what it stops (what it names, or all of a batch)
            if req.all or req.batch_id is not None:
                led.drops += 1
            for gid in named:
                led.group_drops[gid] = led.group_drops.get(gid, 0) + 1
        if req.batch_id is not None:  # what the server says that batch left in the background
            named |= self.mgr.background.handed_in_by(req.batch_id)
        self.aborting += 1
        led.dropping += keep == "drop"
        try:
            await self.mgr.abort(req)
        except ApiError as exc:
            self.note(f"{label}: {exc.code}")
            self.allowed("abort", exc, sorted(named))
            return
        except OSError as exc:  # it may have stopped some of them: the background may forget
            if not self.injected(label, exc):
                raise
            led.background -= set(led.background) if req.all else named
            return
        except asyncio.CancelledError:  # abandoned half-way: the same
            self.note(f"{label}: abandoned")
            led.background -= set(led.background) if req.all else named
            raise
        finally:
            self.aborting -= 1
            led.dropping -= keep == "drop"
        # Right as it returns: nothing it named generates, no call still counts on it, and the
        # background no longer wants it.
        mgr = self.mgr
        for gid in named if not req.all else set(mgr.background.wanted) | named:
            holder = mgr.buffer.owner_of(gid)
            call = mgr.calls.get(holder or "")
            require(
                call is None or gid in call.state.given_up,
                f"{label}: call {holder} still holds {gid} without giving it up",
            )
            require(gid not in mgr.background.wanted, f"{label}: background still wants {gid}")
        self.note(f"{label}: done")
        for gid in list(led.background) if req.all else named:
            led.background.discard(gid)
        self.check()

    async def op_delete(self) -> None:
        known = self.known_groups()
        if not known:
            return
        gid = self.rng.choice(known)
        try:
            await self.mgr.delete(gid)
        except ApiError as exc:
            self.note(f"delete {gid}: {exc.code}")
            self.allowed("delete", exc, [gid])
            return
        except OSError as exc:
            if not self.injected(f"delete {gid}", exc):
                raise
            return
        except asyncio.CancelledError:  # deleted or not, its client cannot know
            self.note(f"delete {gid}: abandoned")
            self.ledger.maybe_gone.add(gid)
            self.ledger.leave(gid)
            raise
        self.note(f"delete {gid}: done")
        require(not self.mgr.buffer.known(gid), f"delete {gid}: still known")
        self.ledger.deleted.add(gid)
        self.ledger.leave(gid)
        self.check()

    async def op_resume(self) -> None:
        known = self.known_groups()
        if not known:
            return
        gid = self.rng.choice(known)
        sid = f"{gid}/0"
        try:
            out = await self.mgr.resume(ResumeReq(sample_ids=[sid]))
        except OSError as exc:
            if not self.injected(f"resume {sid}", exc):
                raise
            return
        except ApiError as exc:
            self.note(f"resume {sid}: {exc.code}")
            if exc.status == 404 and "sample" in str(exc) and self.mgr.buffer.known(gid):
                return  # a group of one member has no /0? (never: ids start at 0)
            self.allowed("resume", exc, [gid])
            return
        self.note(f"resume {sid}: {out[0].status}")
        self.check()

    async def op_push(self) -> None:
        seg = self.mgr.weight_cut
        if not seg.updated.is_set():
            return  # one weight update at a time, as the server's weight hooks ensure
        self.note(f"push to {self.version() + 1} begins")
        await seg.before_update()
        await asyncio.sleep(self.rng.uniform(0, 0.02))
        self.eng.version = str(self.version() + 1)
        behind = self.eng.push_fails_on() if self.plan.on else None
        seg.after_update()
        self.note(f"push to {self.version()} done" + (f", failed on {behind}" if behind else ""))
        if behind is not None:  # a probe brings it level a while later
            self.late.append(asyncio.ensure_future(self.level(behind)))
        self.check()

    async def level(self, engine: str) -> None:
        await asyncio.sleep(self.rng.uniform(0.02, 0.5))
        self.eng.stale.discard(engine)
        self.note(f"engine {engine} level again")

    async def op_engine_errors(self) -> None:
        self.eng.fail_p = self.rng.uniform(0.05, 0.3)
        await asyncio.sleep(self.rng.uniform(0.01, 0.1))
        self.eng.fail_p = 0.0
