"""Simulated clients of what only a seed with faults drives (`faults.py`): clients that abandon
any operation (not only calls), `POST /groups` abandoned and retried with its `request_id`,
listings of `/partials`, resumes with `kv` modes and answers in `append_ids`, and the
options of a call that the older clients never set (`reject` within `reject_grace_s`,
`max_inflight_groups: "auto"`, `length_order`, routed experts, answers as text)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from april_client.protocol import GroupsReq, RejectReq, ResumeReq, RolloutReq
from april_server.buffer.buffer_index import PartialsFilter
from april_server.rules import turns
from april_server.wire.errors import ApiError
from tests.sim.base import WorldBase, group_of
from tests.sim.ledger import require

# Extra client operations of a seed with faults, and how often each is drawn.
FEATURE_OPS: list[tuple[str, float]] = [
    ("op_abandon", 2.5),
    ("op_groups_abandoned", 1.2),
    ("op_list", 1),
    ("op_resume_with", 1),
]


class FeatureClients(WorldBase):
    # ---- options of a call and of an answer --------------------------------------------------

    def call_options(self, req: RolloutReq) -> None:
        """What a seed with faults also sets on a call (the older clients never did)."""
        rng = self.rng
        if rng.random() < 0.3:
            req.max_inflight_groups = "auto"
        req.length_order = rng.choice([None, None, "arrival", "longest_first", "shortest_first"])
        if req.stream and rng.random() < 0.5:
            req.reject_grace_s = rng.uniform(0.0, 0.05)
        if self.eng.routing_format is not None and rng.random() < 0.5:
            req.return_routed_experts = True

    async def maybe_reject(self, batch_id: str, gid: str) -> None:
        """A trainer rejecting a finished group (DAPO filtering), streamed calls only."""
        if not self.plan.on or self.rng.random() > 0.3:
            return
        try:
            self.mgr.reject(batch_id, RejectReq(group_ids=[gid]))
        except ApiError as exc:  # the call ended meanwhile (404, 409 batch_done)
            require(exc.code in ("not_found", "batch_done"), f"reject {gid}: {exc}")
            self.note(f"reject {gid} in {batch_id}: {exc.code}")
            return
        self.note(f"reject {gid} in {batch_id}: taken")

    def answer_text(self, sid: str, turn: int) -> tuple[str | None, list[int]]:
        """An answer as text (the server tokenizes it, off the loop), with its ids."""
        if not self.plan.on or self.rng.random() > 0.3:
            return None, []
        text = "".join(chr(0x41 + (len(sid) * 7 + turn * 3 + i) % 26) for i in range(2))
        return text, self.eng.tokenize(text, False)

    # ---- abandoned operations -----------------------------------------------------------------

    async def abandon(self, what: Callable[[], Awaitable[None]], within: float = 0.02) -> None:
        """Run `what` and cancel it at a random moment (its client went away)."""
        task = asyncio.ensure_future(what())
        await asyncio.sleep(self.rng.uniform(0, within))
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if isinstance(outcome, Exception):  # a failed check, not the cancellation
            raise outcome

    async def op_abandon(self) -> None:
        """Any operation a client can abandon, abandoned."""
        names = ["op_delete", "op_abort", "op_resume", "op_answer", "op_list", "op_resume_with"]
        name = self.rng.choice(names)
        await self.abandon(getattr(self, name))

    async def op_groups_abandoned(self) -> None:
        """`POST /groups` abandoned at a random moment, then sent again with its `request_id`:
        the answer (stored, or made now) says the groups are durable and, with `background`,
        handed to the background."""
        rng = self.rng
        gids = [self.fresh("p") for _ in range(rng.randint(1, 3))]
        req = GroupsReq(
            groups=[self.spec(g, rng.random() < 0.35) for g in gids],
            start=rng.choice(["background", "background", "idle"]),
            max_staleness=rng.choice([None, 0, 1, 2]),
            request_id=self.fresh("q"),
        )
        label = f"groups {req.request_id} {gids} {req.start}"
        # An abort running now or begun from now on may end their background life.
        aborts = self.aborts if not self.aborting else -1

        async def first() -> None:
            try:
                await self.mgr.add_groups(req)
            except asyncio.CancelledError:
                self.note(f"{label}: abandoned")
                raise
            except (ApiError, OSError):
                return
            self.note(f"{label}: ok (unseen)")

        await self.abandon(first, within=0.01)
        try:
            resp = await self.mgr.add_groups(req)
        except ApiError as exc:
            self.note(f"{label} retry: {exc.code}")
            self.allowed("groups", exc, gids)
            return
        except OSError as exc:
            if not self.injected(f"{label} retry", exc):
                raise
            return
        self.note(f"{label} retry: ok")
        require(resp.group_ids == gids, f"{label}: answered {resp.group_ids}")
        for gid in gids:
            self.ledger.create(gid, req.request_id or "")
            if req.start == "background":
                if self.aborts == aborts:
                    self.ledger.background.add(gid)
                self.ledger.handed_by.pop(gid, None)
                self.ledger.bound(gid, req.max_staleness)
        self.check()

    # ---- listings and resumes -----------------------------------------------------------------

    async def op_list(self) -> None:
        """`GET /partials` page by page (a filter drawn at random), or one group: every
        sample shown is whole (its tokens the engine's, its segments covering them)."""
        rng = self.rng
        known = self.known_groups()
        if known and rng.random() < 0.3:
            gid = rng.choice(known)
            try:
                g = await self.mgr.show_partial(gid)
            except ApiError as exc:
                self.allowed("list", exc, [gid])
                return
            except OSError as exc:
                if not self.injected(f"show {gid}", exc):
                    raise
                return
            self.shown([g])
            return
        where = PartialsFilter(
            status=rng.choice([None, "partial", "finished"]),
            min_age_s=rng.choice([None, 0.0, 0.05]),
            weight_version=rng.choice([None, str(self.version())]),
        )
        start = 0
        for _ in range(rng.randint(1, 3)):
            try:
                page = await self.mgr.list_partials(start, rng.randint(1, 4), where)
            except OSError as exc:
                if not self.injected("list", exc):
                    raise
                return
            self.shown(page.groups)
            if page.next_cursor is None:
                break
            start = int(page.next_cursor)

    def shown(self, groups: list[Any]) -> None:
        for g in groups:
            require(g.state in ("running", "finished", "idle", "awaiting"), f"{g.group_id} state")
            for s in g.samples:
                self.ledger.check_sample(s, answers=False)

    async def op_resume_with(self) -> None:
        """`POST /resume` with a `kv` mode and a bound, and the answer of a member that
        awaits input given in `append_ids`."""
        rng = self.rng
        kv = rng.choice(["auto", "restore", "recompute"])
        staleness = rng.choice([None, 0, 1])
        ids: list[int] = []
        if self.pending and rng.random() < 0.5:
            sid, turn = self.pending.pop(rng.randrange(len(self.pending)))
            ids = [(len(sid) + turn) % 60 + 1, turn]
        else:
            known = self.known_groups()
            if not known:
                return
            sid, turn = f"{rng.choice(known)}/0", 0
        req = ResumeReq(
            sample_ids=[sid],
            append_ids={sid: ids} if ids else None,
            kv=kv,
            max_staleness=staleness,
        )
        label = f"resume {sid} kv={kv}" + (f" answering turn {turn}" if ids else "")
        self.answer_seq += 1
        key = self.answer_seq
        if ids:
            self.answering[key] = (sid, ids)  # taken or not, if the process dies meanwhile
            # Appended to a member that finished meanwhile, it reopens the group, which the
            # background (if it had it) does not want again: its client's doing.
            self.ledger.background.discard(group_of(sid))
        try:
            out = await self.mgr.resume(req)
        except ApiError as exc:
            self.note(f"{label}: {exc.code}")
            if ids:
                self.pending.append((sid, turn))  # not taken: answered later
            self.allowed("resume", exc, [group_of(sid)])
            return
        except asyncio.CancelledError:
            self.note(f"{label}: abandoned")
            if ids:
                self.ledger.answer_taken(sid, ids, False, None)
            raise
        except OSError as exc:  # its claim or its commit failed: given back as it was
            if not self.injected(label, exc):
                raise
            return
        finally:
            self.answering.pop(key, None)
        self.note(f"{label}: {out[0].status}")
        if ids:
            held = ids in [a.ids for a in out[0].appended]
            restarts = out[0].staleness_restarts if held else -1
            self.ledger.answer_taken(sid, ids, True, None, restarts)
            if turns.awaiting(out[0]):
                self.pending.append((sid, out[0].turn))
        self.check()
