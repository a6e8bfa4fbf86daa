"""Where each sample's KV snapshot lives: the engine and DP rank of the segment that left it.

The server's own record, not the sample's: a trainer never needs it (the sample says how big
its snapshot is and under which weights it was taken); placement, the drops and the sweep do.
It lives in memory for as long as the process, as the snapshots themselves do: a restarted
server holds none (the store clears the figures of every sample it loads from an earlier boot,
`buffer/store.py`), so there is nothing to make durable.
"""

from __future__ import annotations

from april_client.protocol import Sample
from april_server.rules import snapshots as snapshot_rules
from april_server.rules.placement import Slot


class SnapshotPlaces:
    def __init__(self) -> None:
        # sample id -> the slot holding its snapshot, and which snapshot that is (one more for
        # each recorded), so a check that awaited the engines can tell whether the snapshot it
        # asked about is still the one
        self._at: dict[str, tuple[Slot, int]] = {}
        self._recorded = 0

    def __len__(self) -> int:
        return len(self._at)

    def stamp(self, sample: Sample) -> tuple[Slot | None, int]:
        """Where the sample's snapshot is, and which one it is (changes at every record)."""
        at = self._at.get(sample.sample_id)
        return self.of(sample), 0 if at is None else at[1]

    def of(self, sample: Sample) -> Slot | None:
        """The slot holding the sample's snapshot, None when it has none (its figures say)."""
        if sample.snapshot_bytes <= 0:
            return None
        at = self._at.get(sample.sample_id)
        return Slot() if at is None else at[0]

    def record(self, sample: Sample, nbytes: int, slot: Slot, restored: bool = False) -> None:
        """The snapshot a segment's abort left on `slot` (`snapshots.record` tags it)."""
        snapshot_rules.record(sample, nbytes, restored)
        self._recorded += 1
        self._at[sample.sample_id] = (slot, self._recorded)

    def clear(self, sample: Sample) -> None:
        """The sample holds no snapshot any more."""
        snapshot_rules.clear(sample)
        self._at.pop(sample.sample_id, None)

    def forget(self, sample_id: str, slot: Slot | None) -> None:
        """The snapshot on `slot` was freed: where a sample's figures were cleared by a pure
        rule (a staleness restart), this is where its place goes too."""
        at = self._at.get(sample_id)
        if slot is not None and at is not None and at[0] == slot:
            del self._at[sample_id]
