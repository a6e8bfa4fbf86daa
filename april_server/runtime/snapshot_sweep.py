"""Free KV snapshots that nobody refers to any more, so no bytes stay held after a drain.

A snapshot is referenced while its sample runs (`SegmentRunner.running`: a mark may be about to make
one, a restore holds one) and while its buffered sample records it (`SnapshotPlaces.of`). The
owner frees every snapshot when those end (`segment_runner.py`), and the paths where an engine could
keep one unknown to it are closed where they happen (`fleet/remote.py`: segments whose answer was
lost, drops an engine missed while out of reach). But the owner and its engines are separate
processes on a network: a leak there lasts until the engine restarts, and one was still seen
after the known paths were closed. So the owner also sweeps: every `interval_s` it lists every
engine's snapshots and frees each one that is older than `min_age_s`, referenced by nobody, and
was so on the previous sweep too. Work per sweep is proportional to the snapshots held (one
lookup each), never to the buffer.

Why the rules make it safe: a snapshot is recorded by its sample in the same step of the event
loop in which its segment stops running, so a live one is never unreferenced; age and a second
sweep only add margin against that reasoning being wrong somewhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from april_client.protocol import Sample
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.base import SnapshotEngine
from april_server.engine.segment_state import Running
from april_server.engine.snapshot_places import SnapshotPlaces
from april_server.rules.placement import Slot
from april_server.wire.ids import split_sample_id

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 10.0  # the owner's default (`--april-snapshot-sweep-s`)
MIN_AGE_S = 30.0  # younger snapshots are never swept, whatever the books say


class SnapshotSweep:
    def __init__(
        self,
        snap: SnapshotEngine,
        running: Mapping[str, Running],
        buffer: PartialBuffer,
        places: SnapshotPlaces,
        interval_s: float = SWEEP_INTERVAL_S,
        min_age_s: float = MIN_AGE_S,
    ) -> None:
        """`snap`: the engines' snapshot store; `running`: what generates now, by sample id."""
        self.snap = snap
        self.running = running
        self.buffer = buffer
        self.places = places  # where each sample's snapshot lives, by the server's books
        self.interval_s = interval_s
        self.min_age_s = min_age_s
        self.suspects: set[tuple[Slot, str]] = set()  # unreferenced on the last sweep
        self.sweeps = 0
        self.freed = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep_once()
            except Exception:  # the sweep must outlive one bad round (an engine gone mid-way)
                logger.exception("april: snapshot sweep failed")

    async def sweep_once(self) -> int:
        """One sweep; returns how many snapshots it freed."""
        snap = self.snap
        held = await snap.snapshot_keys()
        old = [
            (s, key)
            for s, ages in held.items()
            for key, age in ages.items()
            if age >= self.min_age_s
        ]
        orphans = await self._unreferenced(old)
        due, self.suspects = orphans & self.suspects, orphans - self.suspects
        self.sweeps += 1
        freed = 0
        for slot, key in sorted(due):
            if self._referenced_now(key, slot):  # the drops before it let other work run
                continue
            await snap.drop_snapshot(key, slot)
            freed += 1
        if freed:
            self.freed += freed
            logger.warning(
                "april: freed %d snapshots nobody referred to: %s", freed, sorted(due)[:8]
            )
        return freed

    async def _unreferenced(self, held: list[tuple[Slot, str]]) -> set[tuple[Slot, str]]:
        maybe = [(slot, key) for slot, key in held if not self._referenced_now(key, slot)]
        idle = {_parts(key)[0] for _, key in maybe} - set(self.buffer.holders)
        bodies = await self.buffer.read_bodies(sorted(g for g in idle if g))
        out = set()
        for slot, key in maybe:
            if self._referenced_now(key, slot):  # claimed while the bodies were read
                continue
            gid, idx = _parts(key)
            group = bodies.get(gid)
            sample = _sample(group.samples if group else [], idx)
            if sample is None or self.places.of(sample) != slot:
                out.add((slot, key))
        return out

    def _referenced_now(self, key: str, slot: Slot) -> bool:
        """What memory says: it runs, or its group is held by a call (or being claimed)."""
        if key in self.running:
            return True
        gid, idx = _parts(key)
        if gid not in self.buffer.holders:
            return False  # idle or gone: its body, read from the store, decides
        group = self.buffer.claimed.get(gid)
        if group is None:
            return True  # being claimed: its body is in flight
        sample = _sample(group.samples, idx)
        return sample is not None and self.places.of(sample) == slot

    def stats(self) -> dict[str, int]:
        return {"snapshot_sweeps": self.sweeps, "snapshots_swept": self.freed}


def _parts(key: str) -> tuple[str, int]:
    """(group id, member index) of a snapshot key (a sample id); ("", -1) for any other."""
    return split_sample_id(key) or ("", -1)


def _sample(samples: list[Sample], idx: int) -> Sample | None:
    return samples[idx] if 0 <= idx < len(samples) else None
