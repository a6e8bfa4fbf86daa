"""Where a segment runs: a pure decision from load, snapshot location and engine health.

A *slot* is one place that generates: an engine (the single local one is `"local"`) and an
SGLang data-parallel rank on it (0 without DP). The rules:
- a continuation whose KV snapshot is usable runs on the slot that holds it, and restores it
  there first (the snapshot lives in that rank's host memory; no other rank can match it);
- everything else goes to the least loaded healthy slot (fewest running samples, then least
  KV need, then the lowest slot: deterministic, so a test can predict it);
- a snapshot that will not be used (unusable, or its slot is gone or unhealthy) is freed
  where it lives before the segment starts: the segment replaces it or finishes without it.

No I/O: the manager gathers the inputs, the engine (`door/`) performs the plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

LOCAL = "local"


@dataclass(frozen=True, slots=True, order=True)
class Slot:
    engine: str = LOCAL
    dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class SlotLoad:
    """What one slot is running for this server, as the manager counts it."""

    slot: Slot
    running: int = 0  # samples generating there
    kv_tokens: float = 0.0  # their KV need (context + remaining budget)
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    slot: Slot  # where the segment runs
    restore: bool = False  # restore the sample's snapshot on `slot` before generating
    drop: Slot | None = None  # free the sample's snapshot held there first (it goes unused)


class NoHealthySlot(RuntimeError):
    """Nothing can generate: every slot is unhealthy (or there is none)."""


def least_loaded(loads: Iterable[SlotLoad]) -> Slot:
    healthy = [x for x in loads if x.healthy]
    if not healthy:
        raise NoHealthySlot("no healthy engine slot to run on")
    return min(healthy, key=lambda x: (x.running, x.kv_tokens, x.slot)).slot


def plan_segment(
    loads: Sequence[SlotLoad], snapshot_at: Slot | None, use_snapshot: bool
) -> SegmentPlan:
    """`snapshot_at`: where the sample's KV snapshot lives (None: it has none);
    `use_snapshot`: the snapshot policy allows restoring it (weight version, `kv` mode)."""
    if snapshot_at is not None and use_snapshot:
        if any(x.slot == snapshot_at and x.healthy for x in loads):
            return SegmentPlan(snapshot_at, restore=True)
    return SegmentPlan(least_loaded(loads), drop=snapshot_at)
