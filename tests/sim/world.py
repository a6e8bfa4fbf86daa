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
import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from april_client.protocol import (
    AbortReq,
    GroupFinishedEvent,
    GroupSpec,
    GroupsReq,
    InputReq,
    ResumeReq,
    RolloutReq,
    RolloutResp,
    SampleAwaitingEvent,
    StreamEvent,
    TurnsSpec,
)
from april_server.buffer.store import BufferStore
from april_server.calls.rollout import rollout
from april_server.operations.abort import abort
from april_server.operations.delete import delete
from april_server.operations.groups import add_groups
from april_server.operations.inputs import post_input
from april_server.operations.resume import resume
from april_server.rules import samples as S
from april_server.rules import turns as T
from april_server.rules.idempotency import is_attempt
from april_server.runtime.manager import RolloutManager
from april_server.wire.errors import ApiError
from tests.sim.engine import SimEngine
from tests.sim.ledger import Ledger, require

STOPS = [9, 17, 33, 41, 50]  # turn stops of agent groups
KEEPS = ["snapshot", "tokens", "drop"]


class World:
    def __init__(self, seed: int, rng: random.Random) -> None:
        self.seed = seed
        self.rng = rng
        self.eng = SimEngine(random.Random(rng.random()))
        self.store = BufferStore(None)
        self.mgr = RolloutManager(self.eng, self.store)
        self.ledger = Ledger()
        self.next_id = 0
        self.inflight = 0
        self.batches: list[str] = []  # batch ids of calls that answered
        self.pending: list[tuple[str, int]] = []  # awaiting members nobody answered
        self.late: list[asyncio.Task[None]] = []
        self.abandoned: list[tuple[RolloutReq, list[str], int]] = []
        self.first_start: dict[str, int] = {}  # request_id -> version its first attempt began
        self.trace: list[str] = []  # what each client did, in order: printed on a failure
        self.check_p = 0.02  # chance of an integrity check between two callbacks

    # ---- helpers -----------------------------------------------------------------------------

    def fresh(self, prefix: str) -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def note(self, what: str) -> None:
        t = asyncio.get_running_loop().time() - 1_000_000.0
        self.trace.append(f"{t:9.4f} {what}")

    def version(self) -> int:
        return int(self.eng.version)

    def spec(self, gid: str, agent: bool) -> GroupSpec:
        budget = self.rng.randint(4, 60)
        params: dict[str, Any] = {"max_new_tokens": budget, "temperature": 0.0}
        if not agent and self.rng.random() < 0.7:
            params["ignore_eos"] = True
        turns = TurnsSpec(stop_token_ids=STOPS, max_turns=3) if agent else None
        n = self.rng.randint(1, 3)
        return GroupSpec(
            gid, input_ids=[7, self.rng.randint(3, 60)], n=n, sampling_params=params, turns=turns
        )

    def known_groups(self) -> list[str]:
        return sorted(
            self.ledger.acked
            - set(self.ledger.delivered)
            - self.ledger.deleted
            - self.ledger.dropped
        )

    def check(self) -> None:
        self.mgr.check_integrity()
        require(not self.eng.double, f"a sample ran twice at once: {self.eng.double}")

    def after_step(self) -> None:
        if self.rng.random() < self.check_p:
            self.check()

    # ---- the error codes a state allows ------------------------------------------------------

    def allowed(self, op: str, exc: ApiError, groups: list[str]) -> None:
        """`exc` came back for `op` on `groups`: is it what the state allowed when it was
        raised (`error_state`: who held what at that moment)?"""
        code = exc.code
        holders, idle = getattr(exc, "sim_state", ({}, set()))
        if exc.status == 404:  # judged for the group it names
            named = re.findall(r"'([^']+)'", exc.message)[:1]
            ids = [n.split("/")[0] for n in named] or groups
            live = [g for g in ids if g in holders or g in idle]
            require(not live, f"{op}: 404 ({exc}) while the server held {live}")
            return
        if code == "group_exists":
            require(any(g in holders or g in idle for g in groups), f"{op}: {exc}, none known")
            return
        if code in ("group_busy", "sample_busy"):
            require(op in ("delete", "answer", "resume"), f"{op} got {code}: {exc}")
            held = [g for g in groups if g in holders]
            require(bool(held), f"{op}: {exc} while none of {groups} was held")
            return
        if code in ("not_awaiting", "invalid_budget", "context_overflow"):
            require(op == "answer", f"{op} got {code}")
            return
        if code in ("sample_finished", "awaiting_input", "no_snapshot"):
            require(op == "resume", f"{op} got {code}")
            return
        if code == "invalid_target":
            require(op.startswith("call"), f"{op} got {code}")
            return  # judged by the caller, who knows what it sent
        raise AssertionError(f"{op}: unexpected error {exc.status} {code}: {exc}")

    # ---- client operations -------------------------------------------------------------------

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
        self, req: RolloutReq, gids: list[str], abandoned: bool = False, retry: bool = False
    ) -> None:
        label = f"call {req.request_id or ''} {gids} target {req.target_groups} {req.on_quota}"
        self.note(f"{label} {'(retry)' if retry else ''} starts")
        events: asyncio.Queue[StreamEvent | None] | None = asyncio.Queue() if req.stream else None
        # The version the delivering attempt started under (a retry may be answered with the
        # response of the first attempt of its request_id).
        start_version = self.first_start.setdefault(req.request_id or "", self.version())
        if req.request_id is None:
            start_version = self.version()
        reader = None
        if events is not None:
            reader = asyncio.ensure_future(self.read_events(events))
        try:
            resp = await rollout(self.mgr, req, events)
        except ApiError as exc:
            self.note(f"{label}: {exc.code}")
            self.allowed("call", exc, gids)
            if exc.code == "invalid_target" and retry and not req.resume_first:
                self.retry_target_allowed(req, gids)
            return
        except asyncio.CancelledError:
            self.note(f"{label}: abandoned")
            raise
        finally:
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
        for gid in gids:  # a stored response speaks for the groups of the attempt it answered
            if gid in named:
                led.create(gid, req.request_id or resp.batch_id)
        led.deliver(resp.groups, start_version)
        for gid in resp.dropped_group_ids:
            led.dropped.add(gid)
            led.leave(gid)
        bg = self.mgr.background
        for gid in resp.buffered_group_ids:  # handed to the background: the server says so
            if req.on_quota == "continue" and bg.handed_by.get(gid) == resp.batch_id:
                led.background.add(gid)
                led.handed_by[gid] = resp.batch_id
                led.bound(gid, req.max_staleness)

    async def settle_abandoned(self) -> None:
        """What abandoned calls delivered as their client went away (their stored response)."""
        abandoned, self.abandoned = self.abandoned, []
        for req, gids, start_version in abandoned:
            rid = req.request_id or ""
            if rid in self.ledger.answered:
                continue
            stored = await self.mgr.store.load_call(rid)
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

    async def read_events(self, events: asyncio.Queue[StreamEvent | None]) -> None:
        while (ev := await events.get()) is not None:
            if isinstance(ev, SampleAwaitingEvent):
                sid, turn = ev.sample.sample_id, ev.turn
                how = self.rng.choice(["now", "twice", "late", "never"])
                if how in ("now", "twice"):
                    await self.answer(sid, turn, twice=how == "twice")
                elif how == "late":
                    self.late.append(asyncio.ensure_future(self.answer(sid, turn, delay=True)))
                else:  # never answered: the client aborts the group, or the call would wait
                    self.pending.append((sid, turn))
                    await self.abort_named(ev.sample.group_id)
            elif isinstance(ev, GroupFinishedEvent):
                pass

    async def abort_named(self, gid: str) -> None:
        req = AbortReq(group_ids=[gid], keep=self.rng.choice(KEEPS))
        await self.aborted(req, {gid})

    async def answer(self, sid: str, turn: int, twice: bool = False, delay: bool = False) -> None:
        if delay:
            await asyncio.sleep(self.rng.uniform(0, 0.01 if self.rng.random() < 0.5 else 0.1))
        ids = [(len(sid) + turn) % 60 + 1, turn]
        gid = sid.rpartition("/")[0]
        try:
            await post_input(self.mgr, sid, InputReq(append_ids=ids, turn=turn))
        except ApiError as exc:
            self.note(f"answer {sid} turn {turn}: {exc.code}")
            self.allowed("answer", exc, [gid])
            return
        except asyncio.CancelledError:  # its client went away: taken or not, it cannot know
            self.note(f"answer {sid} turn {turn}: abandoned")
            self.ledger.answers.setdefault(sid, []).append((ids, False))
            raise
        self.note(f"answer {sid} turn {turn}: taken")
        self.ledger.answers.setdefault(sid, []).append((ids, True))
        if twice:
            try:
                await post_input(self.mgr, sid, InputReq(append_ids=ids, turn=turn))
            except ApiError as exc:
                require(exc.code in ("not_awaiting", "not_found"), f"second answer: {exc}")
                if exc.code == "not_found":
                    self.allowed("answer", exc, [gid])
            else:
                raise AssertionError(f"{sid} took a second answer for turn {turn}")

    async def op_answer(self) -> None:
        """Answers that were held back, now, often while a call claims their group."""
        tasks = []
        while self.pending and (not tasks or self.rng.random() < 0.5):
            sid, turn = self.pending.pop(self.rng.randrange(len(self.pending)))
            tasks.append(self.answer(sid, turn, delay=self.rng.random() < 0.5))
        await asyncio.gather(*tasks)

    async def op_answer_beside_call(self) -> None:
        """A held-back answer posted as a call starts that may claim its group: the answer
        waits for the claim to land, then continues the member in that call."""
        bounded = [
            (sid, t) for sid, t in self.pending if sid.rpartition("/")[0] in self.ledger.bounds
        ]
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
        self.ledger.background.add(gid)
        self.ledger.bound(gid, req.max_staleness)
        awaiting = None
        for _ in range(40):  # what GET /partials/{gid} would show
            await asyncio.sleep(0.005)
            if not self.mgr.buffer.known(gid):
                return
            g = await self.mgr.read_group(gid)
            awaiting = next((s for s in g.samples if T.awaiting(s)), None)
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
            self.call(retry, [gid], retry=True),
            self.answer(awaiting.sample_id, awaiting.turn, delay=True),
        )

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
                resp = await add_groups(self.mgr, req)
            except ApiError as exc:
                self.note(f"{label}: {exc.code}")
                self.allowed("groups", exc, gids)
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

    async def op_same_id(self) -> None:
        """Two requests send one new group id at once: exactly one may create it."""
        gid = self.fresh("d")
        ok: list[str] = []

        async def by_groups() -> None:
            try:
                await add_groups(self.mgr, GroupsReq(groups=[self.spec(gid, False)], start="idle"))
                ok.append("groups")
            except ApiError as exc:
                self.allowed("groups", exc, [gid])

        async def by_call() -> None:
            req = RolloutReq(
                groups=[self.spec(gid, False)],
                target_groups=1,
                on_quota="tokens",
                max_inflight_groups=1,
            )
            start_version = self.version()
            try:
                resp = await rollout(self.mgr, req)
            except ApiError as exc:
                self.allowed("call", exc, [gid])
                return
            ok.append("call")
            self.ledger.deliver(resp.groups, start_version)
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
                await add_groups(
                    self.mgr, GroupsReq(groups=[self.spec(extra, False)], start="idle")
                )
            except ApiError as exc:
                self.allowed("groups", exc, [extra])
                return
            ok.append("groups")
            self.ledger.create(extra, "rival")

        async def retry() -> None:
            await self.call(grown, [*gids, extra], retry=True)
            if self.ledger.created.get(extra) not in (None, "rival"):
                ok.append("retry")

        await asyncio.gather(rival(), retry())
        self.note(f"retry grown by {extra}: created by {ok}")

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
        named = set(req.group_ids or []) | {s.rpartition("/")[0] for s in req.sample_ids or []}
        await self.aborted(req, named)

    async def aborted(self, req: AbortReq, named: set[str]) -> None:
        led, keep = self.ledger, req.keep
        label = f"abort all={req.all} batch={req.batch_id} named={sorted(named)} keep={keep}"
        self.note(f"{label} starts")
        if req.batch_id is not None:  # what the server says that batch left in the background
            named |= self.mgr.background.handed_in_by(req.batch_id)
        try:
            await abort(self.mgr, req)
        except ApiError as exc:
            self.note(f"{label}: {exc.code}")
            self.allowed("abort", exc, sorted(named))
            return
        # Right as it returns: nothing it named generates, no call still counts on it, and the
        # background no longer wants it.
        mgr = self.mgr
        for gid in named if not req.all else set(mgr.background.wanted) | named:
            holder = mgr.buffer.owner_of(gid)
            call = mgr.calls.get(holder or "")
            require(
                call is None or gid in call.given_up,
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
            await delete(self.mgr, gid)
        except ApiError as exc:
            self.note(f"delete {gid}: {exc.code}")
            self.allowed("delete", exc, [gid])
            return
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
            out = await resume(self.mgr, ResumeReq(sample_ids=[sid]))
        except ApiError as exc:
            self.note(f"resume {sid}: {exc.code}")
            if exc.status == 404 and "sample" in str(exc) and self.mgr.buffer.known(gid):
                return  # a group of one member has no /0? (never: ids start at 0)
            self.allowed("resume", exc, [gid])
            return
        self.note(f"resume {sid}: {out[0].status}")
        self.check()

    async def op_push(self) -> None:
        seg = self.mgr.segments
        if not seg.updated.is_set():
            return  # one weight update at a time, as the server's weight hooks ensure
        self.note(f"push to {self.version() + 1} begins")
        await seg.before_update()
        await asyncio.sleep(self.rng.uniform(0, 0.02))
        self.eng.version = str(self.version() + 1)
        seg.after_update()
        self.note(f"push to {self.version()} done")
        self.check()

    async def op_engine_errors(self) -> None:
        self.eng.fail_p = self.rng.uniform(0.05, 0.3)
        await asyncio.sleep(self.rng.uniform(0.01, 0.1))
        self.eng.fail_p = 0.0

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
            finished = finished or (g is not None and S.group_finished(g))
            require(finished, f"the background forgot {gid} (nobody aborted or took it)")

    async def drain(self) -> None:
        """Answer what waits, abort everything, let the background settle; then nothing may be
        running, held, or lost."""
        for sid, turn in self.pending:
            await self.answer(sid, turn)
        self.pending.clear()
        await self.settle_abandoned()
        await abort(self.mgr, AbortReq(all=True, keep="tokens"))
        self.ledger.background.clear()
        for _ in range(100):
            if self.mgr.background._task is None and not self.mgr.running:
                break
            await asyncio.sleep(0.05)
        mgr, led = self.mgr, self.ledger
        require(not mgr.running, f"still running after the drain: {sorted(mgr.running)}")
        require(not mgr.calls, f"calls left: {sorted(mgr.calls)}")
        require(not mgr.buffer.holders, f"still held: {dict(mgr.buffer.holders)}")
        require(not mgr.input_locks, f"answers left waiting: {sorted(mgr.input_locks)}")
        self.check()
        buffered = {e.group_id for e in mgr.buffer.idle.oldest()}
        gone = set(led.delivered) | led.dropped | led.deleted
        lost = led.acked - gone - buffered
        require(not lost, f"lost: {sorted(lost)}")
        twice = gone & buffered
        require(not (set(led.delivered) & buffered), f"delivered and still buffered: {twice}")
        for g in [*mgr.idle_groups(), *led.bodies]:
            for s in g.samples:
                led.check_sample(s)
                if T.awaiting(s):
                    require(g.group_id in buffered, f"{s.sample_id} awaits outside the buffer")
