"""Where a segment runs: a pure decision from load, snapshot location and engine health.

A *slot* is one place that generates: an engine (the single local one is `"local"`) and an
SGLang data-parallel rank on it (0 without DP). The rules:
- a continuation whose KV snapshot is usable runs on the slot that holds it, and restores it
  there first (the snapshot lives in that rank's host memory; no other rank can match it);
- everything else goes to the least loaded healthy slot (fewest running samples, then least
  KV need, then the lowest slot: deterministic, so a test can predict it);
- a snapshot that will not be used (unusable, or its slot is gone or unhealthy) is freed
  where it lives before the segment starts: the segment replaces it or finishes without it.
- tail placement (`--april-placement tail`, an owner over several engines): a sample predicted
  to run long goes to one slot, the *tail slot* (the highest healthy one), the others to the
  rest, so that one engine carries the tail and the others the body (Seer, RollPacker). It is
  a preference, bounded so neither side idles while the other queues: a slot is preferred only
  while it runs at most `2 x least + 2` samples (`least`: the least loaded healthy slot).
  Samples without a prediction are placed by load alone.

No I/O: the segment planner (`engine/segment_planner.py`) gathers the inputs, the engine
(`door/`) performs the plan.
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
    """What one slot is running for this server, as the segment planner counts it."""

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


def is_long(predicted_remaining: int | None, typical: float) -> bool | None:
    """Whether a sample belongs on the tail slot: predicted to run longer than `typical` (the
    mean finished length so far). None: nothing to tell (no prediction, nothing finished)."""
    if predicted_remaining is None or typical <= 0:
        return None
    return predicted_remaining > typical


def by_length(loads: Iterable[SlotLoad], long: bool | None) -> Slot:
    """Tail placement: the tail slot for a long sample, the least loaded other for a short
    one, within the balance bound; by load alone otherwise."""
    healthy = sorted((x for x in loads if x.healthy), key=lambda x: x.slot)
    if long is None or len(healthy) < 2:
        return least_loaded(healthy)
    tail, body = healthy[-1], healthy[:-1]
    preferred = tail if long else min(body, key=lambda x: (x.running, x.kv_tokens, x.slot))
    least = min(x.running for x in healthy)
    if preferred.running <= 2 * least + 2:
        return preferred.slot
    return least_loaded(healthy)


def plan_segment(
    loads: Sequence[SlotLoad],
    snapshot_at: Slot | None,
    use_snapshot: bool,
    long: bool | None = None,
) -> SegmentPlan:
    """`snapshot_at`: where the sample's KV snapshot lives (None: it has none);
    `use_snapshot`: the snapshot policy allows restoring it (weight version, `kv` mode);
    `long`: tail placement's class of the sample (None: placed by load alone)."""
    if snapshot_at is not None and use_snapshot:
        if any(x.slot == snapshot_at and x.healthy for x in loads):
            return SegmentPlan(snapshot_at, restore=True)
    return SegmentPlan(by_length(loads, long), drop=snapshot_at)
