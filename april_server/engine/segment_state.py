"""What the segment runner keeps per running segment, and the figures segments add to.

`Running` is one sample generating (its engine request, where it runs, how a stop treats
it); `CallTally` is what one call's segments add up to (a segment a call takes over from the
background counts in the call's); `Counters` are the server's running totals (`/stats`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from april_client.protocol import Keep, Sample
from april_server.rules.placement import Slot

BACKGROUND = "background"  # the owner of background segments (background.py)


@dataclass
class Running:
    sample: Sample
    owner: str  # batch id of the call that started it
    rid: str
    task: asyncio.Task[None]
    slot: Slot = field(default_factory=Slot)
    keep: Keep = "tokens"
    marked: bool = False  # a snapshot was requested from the scheduler
    stopping: bool = False  # being aborted: a segment whose engine died does not run again
    # A snapshot a staleness restart made useless, not yet handed to a plan to free.
    unplanned_drop: Slot | None = None
    cut: bool = False  # aborted at a weight update's version boundary, to continue after it
    resuming: bool = False  # cut, its continuation not planned yet
    # Planned, but waiting for a healthy engine to place it on: it has not generated under
    # its plan yet (whoever takes it over would inherit a plan judged by another's rule).
    placing: bool = False
    # Its segment was planned to restore the snapshot: whatever the restore achieved, the
    # snapshot is still held where it was and is freed unless kept as the new one.
    restore_planned: bool = False
    planned_version: str = ""  # the weight version its segment's plan was made under
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    max_staleness: int | None = None  # what its continuations are planned with
    override_params: dict[str, Any] | None = None
    # Whose figures its tokens count in: the call that started it, or the one that took it
    # over from the background (`refill.py`).
    tally: CallTally = field(default_factory=lambda: CallTally())


@dataclass
class Counters:
    rollout_calls: int = 0
    resume_calls: int = 0
    abort_calls: int = 0
    output_tokens: int = 0
    resumed_samples: int = 0
    recomputed_tokens: int = 0
    restored_kv_tokens: int = 0
    staleness_restarts: int = 0
    engine_errors: int = 0
    engine_failovers: int = 0  # segments run again because their engine went away
    returned_groups: int = 0
    dropped_groups: int = 0
    # Segments SGLang said were aborted whose output ended at a stop (stops.py): finished
    # or awaiting input, not interrupted.
    stops_behind_aborts: int = 0


@dataclass
class CallTally:
    """Per-call figures, filled in by the segments the call ran."""

    output_tokens: int = 0
    resumed_samples: int = 0
    recomputed_tokens: int = 0
    restored_kv_tokens: int = 0
    notes: list[str] = field(default_factory=list)
