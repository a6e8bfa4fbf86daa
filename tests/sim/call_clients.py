"""Simulated clients of `POST /rollouts`: plain, streamed, abandoned and retried calls, and the
scenarios around them (a retry that grows, one id sent twice, answers racing a claim)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from april_client.protocol import (
    GroupFinishedEvent,
    GroupSpec,
    GroupsReq,
    RolloutReq,
    RolloutResp,
    SampleAwaitingEvent,
    StreamEvent,
)
from april_server.rules import turns
from april_server.rules.idempotency import is_attempt
from april_server.wire.errors import ApiError
from tests.sim.base import group_of
from tests.sim.feature_clients import FeatureClients
from tests.sim.ledger import require


class CallClients(FeatureClients):
    async def op_call(self) -> None:
        rng = self.rng
        agent = rng.random() < 0.4
        gids = [self.fresh("g") for _ in range(rng.randint(1, 3))]
        specs = [self.spec(g, agent) for g in gids]
        buffered = self.mgr.buffer.idle.claimable
        resume_first = rng.random() < 0.8
        target = rng.randint(1, len(gids) + (min(buffered, 2) if resume_first else 0))
        req = RolloutReq(
            groups=specs,
            target_groups=target,
            resume_first=resume_first,
            on_quota=rng.choice(["snapshot", "tokens", "drop", "continue", "continue"]),
            max_staleness=rng.choice([None, 0, 1, 2]),
            max_inflight_groups=rng.randint(1, 4),
            stream=agent or rng.random() < 0.3,
            request_id=self.fresh("r") if rng.random() < 0.3 else None,
        )
        if self.plan.on:
            self.call_options(req)
        how = rng.choice(["plain", "plain", "abandon", "retry"])
        if how == "plain":
            await self.call(req, gids)
            return
        # Abandoned (the client goes away); a retry sends the same request_id again. It may
        # have delivered as it went away: the drain reads what (`settle_abandoned`).
        if req.request_id is None:
            req.request_id = self.fresh("r")
        self.abandoned.append((req, gids, self.first_start.get(req.request_id, self.version())))
        if req.on_quota == "continue":  # it may hand groups to the background unseen
            self.ledger.loosen(req.max_staleness)
        task = asyncio.ensure_future(self.call(req, gids, abandoned=True))
        await asyncio.sleep(rng.uniform(0, 0.05))
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if isinstance(outcome, Exception):  # a failed check, not the cancellation
            raise outcome
        if how == "retry":
            await asyncio.sleep(rng.uniform(0, 0.02))
            if rng.random() < 0.3:
                req.resume_first = False
            await self.call(req, gids, retry=True)

    async def call(
        self,
        req: RolloutReq,
        gids: list[str],
        abandoned: bool = False,
        retry: bool = False,
        answers: str | None = None,
    ) -> None:
        label = f"call {req.request_id or ''} {gids} target {req.target_groups} {req.on_quota}"
        self.note(f"{label} {'(retry)' if retry else ''} starts")
        events: asyncio.Queue[StreamEvent | None] | None = asyncio.Queue() if req.stream else None
        # The version the delivering attempt started under: a retry is answered with the
        # response its first attempt stored, if that one delivered (it has ended by now).
        start_version = self.version()
        if req.request_id is not None:
            first = self.first_start.setdefault(req.request_id, start_version)
            stored = await self.stored_call(req.request_id) if retry else None
            if stored is not None and not is_attempt(stored):
                start_version = first
        reader = None
        if events is not None:
            reader = asyncio.ensure_future(self.read_events(events, answers))
        self.answer_seq += 1
        key = self.answer_seq
        first_version = self.first_start.get(req.request_id or "", start_version)
        self.calling[key] = (req, gids, first_version)  # if the process dies meanwhile
        if req.request_id is not None:  # which attempt delivered, a stored answer cannot say
            self.bounds_sent.setdefault(req.request_id, []).append(req.max_staleness)
        try:
            resp = await self.mgr.rollout(req, events)
        except ApiError as exc:
            self.note(f"{label}: {exc.code}")
            self.allowed("call", exc, gids)
            if exc.code == "invalid_target" and retry and not req.resume_first:
                self.retry_target_allowed(req, gids)
            return
        except asyncio.CancelledError:
            self.note(f"{label}: abandoned")
            raise
        except OSError as exc:
            if not self.injected(label, exc):
                raise
            # Answers a call took are durable with its outcome: this one's, unknown to its
            # client, failed (so did the answers of any call that ended without answering).
            answered = set(self.batches) | set(self.mgr.calls)
            self.ledger.not_durable({b for b in self.ledger.batches_taking() if b not in answered})
            if req.on_quota == "continue":  # it may have handed groups in with its bound
                self.ledger.loosen(req.max_staleness)
            return
        finally:
            self.calling.pop(key, None)
            if events is not None and reader is not None:
                events.put_nowait(None)
                await reader
        self.note(f"{label}: {resp.batch_id} delivered {[g.group_id for g in resp.groups]}")
        self.answered(req, gids, resp, start_version, label)
        self.check()

    def answered(
        self, req: RolloutReq, gids: list[str], resp: RolloutResp, start_version: int, label: str
    ) -> None:
        self.batches.append(resp.batch_id)
        led = self.ledger
        if req.request_id is not None:  # a retry answered with the stored response
            earlier = led.answered.setdefault(req.request_id, resp.batch_id)
            if earlier != resp.batch_id or resp.batch_id in self.batches[:-1]:
                require(earlier == resp.batch_id, f"{label}: two answers for one request_id")
                return
        named = {g.group_id for g in resp.groups} | set(resp.buffered_group_ids)
        named |= set(resp.dropped_group_ids)
        at = self.at_crash if self.after_crash else None
        for gid in gids:  # a stored response speaks for the groups of the attempt it answered
            if gid in named:
                led.create(gid, req.request_id or resp.batch_id)
                # Read after the process died, it may speak of a group an unacknowledged
                # operation had removed by then (as `crashed` judges those acknowledged).
                if at is not None and (gid not in at.known or gid in at.removers):
                    led.maybe_gone.add(gid)
        own = req.max_staleness
        sent = self.bounds_sent.get(req.request_id or "", [])
        if sent:  # its attempts' loosest bound: any of them may have delivered
            own = None if None in sent else max(b for b in sent if b is not None)
        led.deliver(resp.groups, start_version, own, resp.batch_id)
        for gid in resp.dropped_group_ids:
            led.dropped.add(gid)
            led.leave(gid)
        bg = self.mgr.background
        for gid in resp.buffered_group_ids:  # handed to the background: the server says so
            if req.on_quota != "continue":
                continue
            if bg.handed_by.get(gid) == resp.batch_id:
                led.background.add(gid)
                led.handed_by[gid] = resp.batch_id
            # Its bound is this call's even if it already finished there (no longer wanted).
            if gid in bg.bounds and bg.bounds[gid] == req.max_staleness:
                led.bound(gid, req.max_staleness)

    async def settle_abandoned(self) -> None:
        """What abandoned calls delivered as their client went away (their stored response)."""
        abandoned, self.abandoned = self.abandoned, []
        for req, gids, start_version in abandoned:
            rid = req.request_id or ""
            if rid in self.ledger.answered:
                continue
            stored = await self.stored_call(rid)
            if stored is not None and not is_attempt(stored):
                resp = msgspec.json.decode(stored, type=RolloutResp)
                self.note(f"abandoned {rid} had delivered {[g.group_id for g in resp.groups]}")
                self.answered(req, gids, resp, start_version, f"abandoned {rid}")

    def retry_target_allowed(self, req: RolloutReq, gids: list[str]) -> None:
        """A retry with `resume_first: false` runs again on its own groups: 400 only when
        some of them left or another call holds them (not an answer, not the background)."""
        buf = self.mgr.buffer
        usable = [g for g in gids if buf.known(g) and not (buf.owner_of(g) or "").startswith("b-")]
        require(
            len(usable) < req.target_groups,
            f"retry: invalid_target though its groups {usable} are all available",
        )

    async def read_events(
        self, events: asyncio.Queue[StreamEvent | None], answers: str | None = None
    ) -> None:
        """Answer each member that awaits input as `answers` says (None: at random)."""
        while (ev := await events.get()) is not None:
            if isinstance(ev, SampleAwaitingEvent):
                sid, turn = ev.sample.sample_id, ev.turn
                how = answers or self.rng.choice(["now", "twice", "late", "never"])
                if how in ("now", "twice"):
                    await self.answer(sid, turn, twice=how == "twice")
                elif how == "late":
                    self.late.append(asyncio.ensure_future(self.answer(sid, turn, delay=True)))
                else:  # never answered: the client aborts the group, or the call would wait
                    self.pending.append((sid, turn))
                    await self.abort_named(ev.sample.group_id)
            elif isinstance(ev, GroupFinishedEvent):
                await self.maybe_reject(ev.batch_id, ev.group.group_id)

    async def op_answer_beside_call(self) -> None:
        """A held-back answer posted as a call starts that may claim its group: the answer
        waits for the claim to land, then continues the member in that call."""
        bounded = [(sid, t) for sid, t in self.pending if group_of(sid) in self.ledger.bounds]
        if not bounded or not self.mgr.buffer.idle.claimable:
            return
        sid, turn = self.rng.choice(bounded)
        self.pending.remove((sid, turn))
        req = RolloutReq(
            groups=[self.spec(self.fresh("g"), False)],
            target_groups=1,
            on_quota=self.rng.choice(["snapshot", "tokens"]),
            max_staleness=None,
            max_inflight_groups=self.rng.randint(2, 4),
        )
        await asyncio.gather(
            self.call(req, [g.group_id for g in req.groups]),
            self.answer(sid, turn, delay=True),
        )

    async def op_agent_under_push(self) -> None:
        """An agent episode across a push: a `continue` call with `max_staleness` hands its
        agent group to the background and its client goes away; once a member awaits an
        answer the weights move, and the client retries (its own group only) while its tool's
        answer arrives, so the answer may wait for the retry's claim to land."""
        rng = self.rng
        gid = self.fresh("a")
        base = self.spec(gid, True)
        spec = GroupSpec(
            gid,
            input_ids=base.input_ids,
            n=rng.randint(2, 3),
            sampling_params=base.sampling_params,
            turns=base.turns,
        )
        req = RolloutReq(
            groups=[spec],
            target_groups=1,
            on_quota="continue",
            max_staleness=rng.choice([0, 1]),
            stream=True,
            request_id=self.fresh("r"),
            max_inflight_groups=1,
        )
        self.abandoned.append((req, [gid], self.version()))
        self.ledger.loosen(req.max_staleness)
        first = asyncio.ensure_future(self.call(req, [gid], abandoned=True))
        await asyncio.sleep(rng.uniform(0.001, 0.01))
        first.cancel()
        (outcome,) = await asyncio.gather(first, return_exceptions=True)
        if isinstance(outcome, Exception):
            raise outcome
        if self.mgr.background.bounds.get(gid) != req.max_staleness:
            return  # gone before it handed the group in
        self.ledger.acked.add(gid)
        if gid in self.mgr.background.wanted:  # unless an abort since made it forget it
            self.ledger.background.add(gid)
        self.ledger.bound(gid, req.max_staleness)
        awaiting = None
        for _ in range(40):  # what GET /partials/{gid} would show
            await asyncio.sleep(0.005)
            if not self.mgr.buffer.known(gid):
                return
            db: Any = self.mgr.store._db
            db.spare_next = True  # the harness's look: never a fault
            try:
                g = await self.mgr.buffer.read_group(gid)
            finally:
                db.spare_next = False
            awaiting = next((s for s in g.samples if turns.awaiting(s)), None)
            if awaiting is not None:
                break
        if awaiting is None:
            return
        self.note(f"agent {gid}: {awaiting.sample_id} awaits turn {awaiting.turn}")
        for _ in range(rng.randint(1, 2)):
            await self.op_push()
        retry = RolloutReq(
            groups=[spec],
            target_groups=1,
            on_quota="tokens",
            stream=True,
            request_id=req.request_id,
            resume_first=False,
            max_inflight_groups=1,
        )
        await asyncio.gather(
            self.call(retry, [gid], retry=True, answers="now"),
            self.answer(awaiting.sample_id, awaiting.turn, delay=True),
        )

    async def op_same_id(self) -> None:
        """Two requests send one new group id at once: exactly one may create it."""
        gid = self.fresh("d")
        ok: list[str] = []

        async def by_groups() -> None:
            try:
                await self.mgr.add_groups(GroupsReq(groups=[self.spec(gid, False)], start="idle"))
                ok.append("groups")
            except ApiError as exc:
                self.allowed("groups", exc, [gid])
            except OSError as exc:
                if not self.injected(f"groups {gid}", exc):
                    raise

        async def by_call() -> None:
            req = RolloutReq(
                groups=[self.spec(gid, False)],
                target_groups=1,
                on_quota="tokens",
                max_inflight_groups=1,
            )
            start_version = self.version()
            try:
                resp = await self.mgr.rollout(req)
            except ApiError as exc:
                self.allowed("call", exc, [gid])
                return
            except OSError as exc:
                if not self.injected(f"call {gid}", exc):
                    raise
                return
            ok.append("call")
            self.ledger.deliver(resp.groups, start_version, req.max_staleness, resp.batch_id)
            for g in resp.dropped_group_ids:
                self.ledger.dropped.add(g)

        makers = [by_groups, by_call, by_groups][self.rng.randrange(2) :][:2]
        await asyncio.gather(*(m() for m in makers))
        self.note(f"same id {gid}: created by {ok}")
        require(len(ok) <= 1, f"group {gid} was created by two requests: {ok}")
        for who in ok:
            self.ledger.created[gid] = who
            self.ledger.acked.add(gid)

    async def op_retry_grows(self) -> None:
        """A retry that sends one more group than its first attempt, while another request
        sends that group's id: the id has one creator, whichever adopts it first."""
        rng = self.rng
        gids = [self.fresh("g") for _ in range(rng.randint(1, 2))]
        extra = self.fresh("x")
        req = RolloutReq(
            groups=[self.spec(g, False) for g in gids],
            target_groups=1,
            on_quota="tokens",
            request_id=self.fresh("r"),
            max_inflight_groups=1,
        )
        self.abandoned.append((req, gids, self.version()))
        first = asyncio.ensure_future(self.call(req, gids, abandoned=True))
        await asyncio.sleep(rng.uniform(0, 0.03))
        first.cancel()
        (outcome,) = await asyncio.gather(first, return_exceptions=True)
        if isinstance(outcome, Exception):
            raise outcome
        grown = RolloutReq(
            groups=[*req.groups, self.spec(extra, False)],
            target_groups=1,
            on_quota="tokens",
            request_id=req.request_id,
            max_inflight_groups=1,
        )
        ok: list[str] = []

        async def rival() -> None:
            await asyncio.sleep(rng.uniform(0, 0.006))
            try:
                await self.mgr.add_groups(GroupsReq(groups=[self.spec(extra, False)], start="idle"))
            except ApiError as exc:
                self.allowed("groups", exc, [extra])
                return
            except OSError as exc:
                if not self.injected(f"groups {extra}", exc):
                    raise
                return
            ok.append("groups")
            self.ledger.create(extra, "rival")

        async def retry() -> None:
            await self.call(grown, [*gids, extra], retry=True)
            if self.ledger.created.get(extra) not in (None, "rival"):
                ok.append("retry")

        await asyncio.gather(rival(), retry())
        self.note(f"retry grown by {extra}: created by {ok}")
