"""What a seed injects, FoundationDB style: each fault is switched on (or not) by the seed, at a
rate drawn by the seed that still lets most operations succeed.

`FaultPlan.off()` injects nothing and draws nothing: the simulator as it was before faults
existed, seed for seed (`python -m tests.sim --no-faults`; `APRIL_SIM_FAULTS=0` for callers of
`run_seed`). `FaultPlan.draw(rng)`: what `--faults` (the default) runs, per seed:
- a crash of the whole process (the server and its engine) at a step drawn log-uniformly over
  a run's length, and a restart that rebuilds the core from the store (`restart.py`);
- store faults (`store.py`): failed commits (a full disk), slow fsyncs, failed reads;
- engine faults (`engine.py`): segments failing part-way, hangs, an owner over two engines
  whose push fails on one, delays on every snapshot operation and on a mark, a capacity
  (the admission bound), routed experts;
- clients that abandon every kind of operation, not only calls (`cancel_p`);
- the server's options: stale KV reuse, the default length order, tail placement.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from april_server.rules.inflight import EngineCapacity
from april_server.settings.config import LengthOrder, Placement
from tests.sim.engine import EngineFaults
from tests.sim.loop import START_TIME
from tests.sim.store import StoreFaults


@dataclass
class ServerOptions:
    """The options a restart rebuilds the core with (`restart.build_core`)."""

    allow_stale_kv: bool = False
    length_order: LengthOrder = "arrival"
    placement: Placement = "least_loaded"


@dataclass
class FaultPlan:
    on: bool = False
    store: StoreFaults = field(default_factory=StoreFaults)
    engine: EngineFaults = field(default_factory=EngineFaults)
    crash_step: int | None = None  # the loop step the first process dies at
    # A client abandons the operation (its task is cancelled at a random moment).
    cancel_p: float = 0.0
    options: ServerOptions = field(default_factory=ServerOptions)

    @staticmethod
    def off() -> FaultPlan:
        return FaultPlan()

    @staticmethod
    def draw(rng: random.Random) -> FaultPlan:
        def maybe(p: float, lo: float, hi: float) -> float:
            return rng.uniform(lo, hi) if rng.random() < p else 0.0

        store = StoreFaults(
            write_fail_p=maybe(0.3, 0.01, 0.08),
            slow_fsync_p=maybe(0.3, 0.05, 0.3),
            read_fail_p=maybe(0.3, 0.01, 0.06),
            passive=True,
        )
        hangs = []
        if rng.random() < 0.2:
            start = START_TIME + rng.uniform(0.0, 0.8)
            hangs.append((start, start + rng.uniform(0.02, 1.0)))
        engines = 2 if rng.random() < 0.35 else 1
        capacity = None
        if rng.random() < 0.5:
            capacity = EngineCapacity(rng.randint(1, 12), rng.randint(150, 2000))
        engine = EngineFaults(
            on=True,
            engines=engines,
            part_fail_p=maybe(0.4, 0.01, 0.08),
            op_delay_s=maybe(0.8, 0.0005, 0.003),
            hangs=hangs,
            push_fail_p=maybe(0.8, 0.2, 0.6) if engines > 1 else 0.0,
            capacity=capacity,
            routing=rng.random() < 0.3,
        )
        crash_step = None
        if rng.random() < 0.3:  # log-uniform: early crashes as likely as late ones
            crash_step = int(math.exp(rng.uniform(math.log(20), math.log(4000))))
        options = ServerOptions(
            allow_stale_kv=rng.random() < 0.3,
            length_order=rng.choice(["arrival", "arrival", "longest_first", "shortest_first"]),
            placement=rng.choice(["least_loaded", "least_loaded", "tail"]),
        )
        return FaultPlan(
            on=True,
            store=store,
            engine=engine,
            crash_step=crash_step,
            cancel_p=rng.uniform(0.05, 0.25),
            options=options,
        )

    def describe(self) -> str:
        """One line for `--verbose`: what this seed injects."""
        if not self.on:
            return "faults: off"
        s, e = self.store, self.engine
        parts = [
            f"crash at step {self.crash_step}" if self.crash_step is not None else "no crash",
            f"store write_fail {s.write_fail_p:.3f} slow_fsync {s.slow_fsync_p:.3f} "
            f"read_fail {s.read_fail_p:.3f}",
            f"engines {e.engines} part_fail {e.part_fail_p:.3f} push_fail {e.push_fail_p:.2f} "
            f"op_delay {e.op_delay_s * 1000:.1f} ms hangs {len(e.hangs)} capacity {e.capacity} "
            f"routing {e.routing}",
            f"cancel {self.cancel_p:.2f}",
            f"options {self.options}",
        ]
        return "faults: " + "; ".join(parts)
