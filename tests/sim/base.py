"""The simulated world's state, helpers, and the error codes a state allows (`world.py` runs it)."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

from april_client.protocol import (
    GroupSpec,
    RolloutReq,
    TurnsSpec,
)
from april_server.wire.errors import ApiError
from april_server.wire.ids import split_sample_id
from tests.sim.engine import SimEngine
from tests.sim.faults import FaultPlan
from tests.sim.ledger import Ledger, require
from tests.sim.loop import Crash
from tests.sim.restart import AtCrash, build_core
from tests.sim.store import SimDb

STOPS = [9, 17, 33, 41, 50]  # turn stops of agent groups
KEEPS = ["snapshot", "tokens", "drop"]


def group_of(name: str) -> str:
    """The group a name denotes: a sample id's group (the server's own parser), else the name
    itself (a group id)."""
    parsed = split_sample_id(name)
    return name if parsed is None else parsed[0]


class WorldBase:
    def __init__(self, seed: int, rng: random.Random, plan: FaultPlan | None = None) -> None:
        self.seed = seed
        self.rng = rng
        self.plan = plan = plan or FaultPlan.off()
        self.eng = SimEngine(random.Random(rng.random()), plan.engine)
        self.mgr = build_core(self.eng, plan.options)
        self.store = self.mgr.store
        self.ledger = Ledger(
            requests_of=lambda sid: self.eng.requests_of(sid),
            failed_groups=lambda: set() if SimDb.disk is None else SimDb.disk.failed_groups,
        )
        self.next_id = 0
        self.inflight = 0
        self.batches: list[str] = []  # batch ids of calls that answered
        self.pending: list[tuple[str, int]] = []  # awaiting members nobody answered
        self.late: list[asyncio.Task[None]] = []
        self.abandoned: list[tuple[RolloutReq, list[str], int]] = []
        self.first_start: dict[str, int] = {}  # request_id -> version its first attempt began
        self.bounds_sent: dict[str, list[int | None]] = {}  # request_id -> its max_staleness
        self.trace: list[str] = []  # what each client did, in order: printed on a failure
        self.check_p = 0.02  # chance of an integrity check between two callbacks
        self.round = 0  # rounds begun (a restart goes on with the next)
        # What clients have in flight, for a crash to judge: answers (key -> sample, ids)
        # and calls (key -> request, its groups, the version its first attempt began under).
        self.answering: dict[int, tuple[str, list[int]]] = {}
        self.answer_seq = 0
        self.calling: dict[int, tuple[RolloutReq, list[str], int]] = {}
        self.crash_step = plan.crash_step
        self.aborts = 0  # aborts begun
        self.aborting = 0  # aborts under way
        # Groups the background wanted as a round of it failed (the store failed under it):
        # it leaves them until the next kick (a call, an answer, `/groups`).
        self.stranded: set[str] = set()
        self.at_crash: AtCrash | None = None
        self.after_crash = False  # settling what clients of a dead process left
        self.stray_writes: list[str] = []  # segment ends recorded where nobody held (watch.py)

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
        prompt = [7, self.rng.randint(3, 60)]
        routed = None
        if self.plan.on and self.eng.routing_format is not None and self.rng.random() < 0.4:
            routed = True
        return GroupSpec(
            gid,
            input_ids=prompt,
            n=n,
            sampling_params=params,
            turns=turns,
            return_routed_experts=routed,
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
        require(not self.stray_writes, self.stray_writes[0] if self.stray_writes else "")

    def after_step(self) -> None:
        if self.rng.random() < self.check_p:
            self.check()
        if self.crash_step is not None:
            loop: Any = asyncio.get_running_loop()
            if loop.steps >= self.crash_step:
                self.crash_step = None  # one crash a seed
                self.at_crash = AtCrash.read(self.mgr, self.eng)
                # Read now: the dead coroutines' `finally` blocks run as they are closed.
                self.at_crash.answering = list(self.answering.values())
                self.at_crash.calling = list(self.calling.values())
                raise Crash(loop.now)

    async def stored_call(self, request_id: str) -> bytes | None:
        """What the store remembers for `request_id` (the harness's read: never a fault)."""
        db: Any = self.mgr.store._db
        db.spare_next = True
        try:
            return await self.mgr.store.load_call(request_id)
        finally:
            db.spare_next = False

    def injected(self, op: str, exc: BaseException) -> bool:
        """Whether `exc` is a store fault this seed injected (the operation answers 500)."""
        if self.plan.on and isinstance(exc, OSError) and str(exc).startswith("simulated"):
            self.note(f"{op}: store failed ({exc})")
            return True
        return False

    # ---- the error codes a state allows ------------------------------------------------------

    def allowed(self, op: str, exc: ApiError, groups: list[str]) -> None:
        """`exc` came back for `op` on `groups`: is it what the state allowed when it was
        raised (`error_state`: who held what at that moment)?"""
        code = exc.code
        holders, idle = getattr(exc, "sim_state", ({}, set()))
        if exc.status == 404:  # judged for the group it names
            named = re.findall(r"'([^']+)'", exc.message)[:1]
            ids = [group_of(n) for n in named] or groups
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
        if code in ("invalid_budget", "context_overflow"):  # an answer too long to fit
            require(op in ("answer", "resume"), f"{op} got {code}")
            return
        if code == "not_awaiting":
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
