"""Run seeds of the simulator: `run_seed(seed)` returns None or what failed, with the trace."""

from __future__ import annotations

import logging
import os
import random
import re
import traceback
from dataclasses import dataclass

from april_server.runtime import background as background_module
from april_server.wire.errors import ApiError
from tests.sim import loop as sim_loop
from tests.sim.faults import FaultPlan
from tests.sim.store import crash_stores, errors_recorded, failures_logged, simulated_store
from tests.sim.watch import segment_ends_watched
from tests.sim.world import World

ROUNDS = 4
MAX_VIRTUAL_S = 600.0
RESTART_S = (0.01, 0.1)  # how long a restart takes, virtual seconds


@dataclass
class Failure:
    seed: int
    check: str  # the first failing check
    trace: list[str]  # what the clients did up to it
    detail: str  # the traceback
    faults: bool = True
    plan: str = ""  # what the seed injected (`FaultPlan.describe`)

    def replay(self) -> str:
        off = "" if self.faults else " --no-faults"
        return f"PYTHONHASHSEED=0 python -m tests.sim --seed {self.seed} --verbose{off}"


def faults_default() -> bool:
    """Faults are on unless `APRIL_SIM_FAULTS=0` (the simulator as it was before them)."""
    return os.environ.get("APRIL_SIM_FAULTS", "1") != "0"


def run_seed(
    seed: int,
    rounds: int = ROUNDS,
    trace_out: list[str] | None = None,
    faults: bool | None = None,
) -> Failure | None:
    """One seed; None when every check passed. `trace_out` receives the clients' trace;
    `faults`: inject the seed's faults (None: `faults_default()`)."""
    faults = faults_default() if faults is None else faults
    rng = random.Random(seed)
    plan = FaultPlan.draw(random.Random(rng.random())) if faults else FaultPlan.off()
    world: World | None = None

    async def first() -> None:
        nonlocal world
        world = World(seed, rng, plan)
        await life(world, world.main(rounds))

    async def again() -> None:
        assert world is not None
        await life(world, world.restarted(rounds))

    async def life(w: World, body: object) -> None:
        loop = sim_loop.asyncio.get_running_loop()
        loop.after_step = w.after_step  # type: ignore[attr-defined]
        try:
            await body  # type: ignore[misc]
        finally:
            loop.after_step = None  # type: ignore[attr-defined]
            w.store.close()  # a dead process's store: a no-op (`SimDb.crash`)

    def error_state(exc: ApiError) -> None:  # who held what as the error was raised
        if world is not None:
            buf = world.mgr.buffer
            exc.sim_state = (  # type: ignore[attr-defined]
                {g: h.owner for g, h in buf.holders.items()},
                {e.group_id for e in buf.idle.oldest()},
            )

    def watched(what: str) -> None:  # judged at the next check (raised in a task, lost)
        if world is not None:
            world.stray_writes.append(what)

    def round_failed() -> None:
        if world is not None:
            world.stranded |= set(world.mgr.background.wanted)

    logging.disable(logging.CRITICAL)  # the server logs injected failures as errors
    try:
        with (
            simulated_store(random.Random(rng.random()), plan.store),
            errors_recorded(error_state),
            failures_logged(background_module, round_failed),
            segment_ends_watched(lambda: None if world is None else world.mgr, watched),
        ):
            crash = sim_loop.run(seed, first, MAX_VIRTUAL_S)
            lives = 1
            while crash is not None:  # the process died: a new one starts from the store
                assert world is not None
                crash_stores()
                world.crashed()
                start = crash.at + rng.uniform(*RESTART_S)
                crash = sim_loop.run(seed * 7919 + lives, again, MAX_VIRTUAL_S, start)
                lives += 1
    except BaseException as exc:  # noqa: BLE001 - every failure is a finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        trace = world.trace if world is not None else []
        check = f"{type(exc).__name__}: {exc}"
        detail = traceback.format_exc()
        if world is not None and world.eng.events:
            named = set(re.findall(r"[a-z]\d+/\d+", check))
            mine = [e for e in world.eng.events if any(n + " " in e for n in named)]
            detail += "engine, the samples it names:\n" + "\n".join(mine[-40:])
        return Failure(seed, check, trace, detail, faults, plan.describe())
    finally:
        logging.disable(logging.NOTSET)
        if trace_out is not None and world is not None:
            trace_out.extend(world.trace)
    return None


def hash_seed_fixed() -> bool:
    return os.environ.get("PYTHONHASHSEED") == "0"
