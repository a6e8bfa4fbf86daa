"""A crash and a restart: the process dies between two callbacks (`loop.Crash`), its store
keeps what was committed (`store.Disk`), and a new process builds the core from it with the
code a server runs at start-up (`build_core`); its engine comes back empty (a restart loses
every KV snapshot) at the weights the trainer pushed last.

What the clients knew as it died decides what the ledger may expect after (`Restarts`):
- every group acknowledged and not delivered, dropped or deleted is buffered, unless an
  operation in flight could have removed it (a call that delivered or dropped it, a delete),
  or it was gone already (acknowledged to nobody yet): those may be either (`maybe_gone`);
- a group delivered, dropped or deleted never comes back;
- an answer a call took is durable only with that call's outcome: uncertain if the call had
  not ended; an answer in flight is uncertain;
- a call in flight with a `request_id` is settled from the store like an abandoned one;
- the background's groups and their bounds are memory only: a restart forgets them (they stay
  buffered, idle, until a call claims them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.settings.config import AprilConfig
from tests.sim.engine import SimEngine
from tests.sim.faults import ServerOptions


def build_core(engine: SimEngine, options: ServerOptions) -> RolloutManager:
    """The core as a server process builds it at start-up: the durable state opened from its
    store (`Durable.open`, the one recovery path: the buffer's index, the length history), then
    the root (`RootHolder.get`, without the loop-lag monitor, whose timer would keep a wedged
    loop looking busy; the simulator drives the weight cut itself). The one place a simulated
    process is built, first or after a crash."""
    config = AprilConfig(
        allow_stale_kv=options.allow_stale_kv,
        snapshot_sweep_s=0.0,  # the ledger checks snapshots itself after the drain
        length_order=options.length_order,
        placement=options.placement,
    )
    return RolloutManager(engine, Durable.open(config.buffer_path), config, sweep_s=0.0)


@dataclass
class AtCrash:
    """What the dying process held, read in the step it died in (before its coroutines were
    closed: their clean-up code changes the dead objects)."""

    known: set[str] = field(default_factory=set)  # groups idle or held
    removers: set[str] = field(default_factory=set)  # held by a call or a delete
    live_calls: set[str] = field(default_factory=set)
    version: str = "0"
    # What the clients had in flight (`WorldBase.answering`, `calling`).
    answering: list[tuple[str, list[int]]] = field(default_factory=list)
    calling: list[tuple[Any, list[str], int]] = field(default_factory=list)

    @staticmethod
    def read(mgr: RolloutManager, engine: SimEngine) -> AtCrash:
        buf = mgr.buffer
        held = dict(buf.holders)
        return AtCrash(
            known=set(held) | {e.group_id for e in buf.idle.oldest()},
            removers={g for g, h in held.items() if h.owner.startswith(("b-", "delete-"))},
            live_calls=set(mgr.calls),
            version=engine.version,
        )


def restarted_engine(old: SimEngine, rng: random.Random) -> SimEngine:
    """The engine of the new process: no snapshot, no request; the weights pushed last."""
    engine = SimEngine(rng, old.faults)
    engine.version = old.version
    engine.requests = old.requests  # the log of what made the segments stored
    engine.failed = old.failed
    return engine
