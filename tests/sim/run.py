"""Run seeds of the simulator: `run_seed(seed)` returns None or what failed, with the trace."""

from __future__ import annotations

import logging
import os
import random
import traceback
from dataclasses import dataclass

from april_server.wire.errors import ApiError
from tests.sim import loop as sim_loop
from tests.sim.store import errors_recorded, simulated_store
from tests.sim.world import World

ROUNDS = 4
MAX_VIRTUAL_S = 600.0


@dataclass
class Failure:
    seed: int
    check: str  # the first failing check
    trace: list[str]  # what the clients did up to it
    detail: str  # the traceback

    def replay(self) -> str:
        return f"PYTHONHASHSEED=0 python -m tests.sim --seed {self.seed} --verbose"


def run_seed(seed: int, rounds: int = ROUNDS, trace_out: list[str] | None = None) -> Failure | None:
    """One seed; None when every check passed. `trace_out` receives the clients' trace."""
    rng = random.Random(seed)
    world: World | None = None

    async def main() -> None:
        nonlocal world
        world = World(seed, rng)
        loop = sim_loop.asyncio.get_running_loop()
        loop.after_step = world.after_step  # type: ignore[attr-defined]
        try:
            await world.main(rounds)
        finally:
            loop.after_step = None  # type: ignore[attr-defined]
            world.store.close()
            if trace_out is not None:
                trace_out.extend(world.trace)

    def error_state(exc: ApiError) -> None:  # who held what as the error was raised
        if world is not None:
            buf = world.mgr.buffer
            exc.sim_state = (  # type: ignore[attr-defined]
                {g: h.owner for g, h in buf.holders.items()},
                {e.group_id for e in buf.idle.oldest()},
            )

    logging.disable(logging.CRITICAL)  # the server logs injected failures as errors
    try:
        with simulated_store(random.Random(rng.random())), errors_recorded(error_state):
            sim_loop.run(seed, main, MAX_VIRTUAL_S)
    except BaseException as exc:  # noqa: BLE001 - every failure is a finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        trace = world.trace if world is not None else []
        check = f"{type(exc).__name__}: {exc}"
        return Failure(seed, check, trace, traceback.format_exc())
    finally:
        logging.disable(logging.NOTSET)
    return None


def hash_seed_fixed() -> bool:
    return os.environ.get("PYTHONHASHSEED") == "0"
