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
from april_server.buffer.store import BufferStore
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.wire.errors import ApiError
from april_server.wire.ids import split_sample_id
from tests.sim.engine import SimEngine
from tests.sim.ledger import Ledger, require

STOPS = [9, 17, 33, 41, 50]  # turn stops of agent groups
KEEPS = ["snapshot", "tokens", "drop"]


def group_of(name: str) -> str:
    """The group a name denotes: a sample id's group (the server's own parser), else the name
    itself (a group id)."""
    parsed = split_sample_id(name)
    return name if parsed is None else parsed[0]


class WorldBase:
    def __init__(self, seed: int, rng: random.Random) -> None:
        self.seed = seed
        self.rng = rng
        self.eng = SimEngine(random.Random(rng.random()))
        self.store = BufferStore(None)
        self.mgr = RolloutManager(self.eng, Durable.load(self.store))
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
