"""Where segments run: what runs on which slot, the admission bound, and a segment's plan.

`SegmentPlanner` holds what the segment runner knows of the engine's load (each slot's
running samples and KV need, the admission bound sized from the engine's capacity) and plans
a segment without I/O: its slot and what the engine does first (`placement.plan_segment`: the
snapshot's slot, else the least loaded one). The runner (`segment_runner.py`) and the weight
cut (`weight_cut.py`) are handed it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from april_client.protocol import Sample
from april_server.engine.base import BaseEngine, SegmentCall, SnapshotEngine
from april_server.engine.segment_state import CallTally, Counters
from april_server.engine.snapshot_places import SnapshotPlaces
from april_server.rules import samples as sample_rules
from april_server.rules import snapshots as snapshot_rules
from april_server.rules.inflight import Admission
from april_server.rules.lengths import LengthModel
from april_server.rules.placement import NoHealthySlot, Slot, SlotLoad, is_long, plan_segment

logger = logging.getLogger(__name__)


class SegmentPlanner:
    def __init__(
        self,
        engine: BaseEngine,
        counters: Counters,
        admission: Admission,
        allow_stale: bool,
        lengths: LengthModel,
        places: SnapshotPlaces,
    ) -> None:
        self.engine = engine
        self.snap: SnapshotEngine | None = None
        if isinstance(engine, SnapshotEngine) and engine.snapshots_enabled:
            self.snap = engine
        self.counters = counters
        self.admission = admission
        self.allow_stale = allow_stale
        self.lengths = lengths  # the tail placement asks which samples are long
        self.places = places  # where each sample's snapshot lives
        self.load: dict[Slot, list[float]] = {}  # slot -> [running samples, KV need]
        self._capacity_key: object = ()  # what the admission bound was sized for

    @property
    def snapshots_enabled(self) -> bool:
        return self.snap is not None

    def usable(
        self, sample: Sample, current: str, history: Sequence[str], max_staleness: int | None
    ) -> bool:
        return self.snap is not None and snapshot_rules.usable(
            sample, current, history, max_staleness, self.allow_stale
        )

    def loads(self) -> list[SlotLoad]:
        out = []
        for slot in self.engine.slots():
            running, kv = self.load.get(slot, (0, 0.0))
            out.append(SlotLoad(slot, int(running), kv, self.engine.healthy(slot)))
        return out

    def add_load(self, slot: Slot, samples: int, kv: float) -> None:
        acc = self.load.setdefault(slot, [0, 0.0])
        acc[0] += samples
        # KV needs are floats taken back in another order than added: an idle slot would
        # keep a residue (~1e-14) that tips placement's ties. Nothing running needs nothing.
        acc[1] = acc[1] + kv if acc[0] else 0.0

    def by_slot(self) -> list[dict[str, Any]]:
        """What this server runs where, for /stats."""
        return [
            {
                "engine": x.slot.engine,
                "dp_rank": x.slot.dp_rank,
                "running_samples": x.running,
                "kv_need_tokens": int(x.kv_tokens),
                "healthy": x.healthy,
            }
            for x in self.loads()
        ]

    async def admission_ready(self) -> Admission:
        """The admission bound, sized from what the engine can run: once for one server, again
        whenever an owner's pool of healthy engines changes (it follows the pool)."""
        key = self.engine.capacity_key()
        if key != self._capacity_key:
            capacity = await self.engine.capacity()
            if capacity is not None:
                self.admission.configure(capacity)
                self._capacity_key = key
        return self.admission

    def count_restart(self, sample: Sample, tally: CallTally) -> None:
        """A staleness restart (`sample_rules.restart_for_staleness` counts it on the sample):
        the server's figure and a note for the call whose figures it counts in."""
        self.counters.staleness_restarts += 1
        tally.notes.append(f"{sample.sample_id}: restarted from its prompt (max_staleness)")

    def plan(
        self,
        sample: Sample,
        owner: str,
        cont: sample_rules.Continuation,
        restore: bool,
        held: Slot | None,
    ) -> SegmentCall | None:
        """Where the segment runs and what the engine does first (None: nowhere healthy).
        `held`: where the sample's snapshot lives (None: it has none)."""
        long = None
        if self.lengths.placement == "tail":
            long = is_long(sample.predicted_remaining, self.lengths.prior)
        try:
            plan = plan_segment(self.loads(), held, restore, long)
        except NoHealthySlot:
            return None
        if plan.drop is not None:
            self.places.clear(sample)  # the engine frees it before the segment runs
        rid = f"{sample.sample_id}@{owner}.{len(sample.segments)}.{uuid.uuid4().hex[:6]}"
        return SegmentCall(
            rid,
            sample.sample_id,
            cont.input_ids,
            cont.sampling_params,
            plan.slot,
            plan.restore,
            plan.drop,
            cont.cache_ns if plan.restore else None,
            0 if sample.return_routed_experts else None,  # a restore moves it (base.py)
            sample.return_sampling_mask,
        )

    async def drop_unexecuted(self, call: SegmentCall) -> None:
        """The plan gave up the sample's old snapshot (`plan` cleared its figures) and left
        freeing it to the engine at the segment's start, but the segment failed, maybe before
        it got there: free it now (a no-op where it was freed). Otherwise nobody knows of it."""
        if call.drop is None or self.snap is None:
            return
        try:
            await self.snap.drop_snapshot(call.key, call.drop)
        except Exception as exc:  # its engine is gone, and the snapshot with it
            logger.warning("april: could not free %s's snapshot: %s", call.key, exc)
