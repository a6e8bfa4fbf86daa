"""When to take, reuse and drop KV snapshots (the policy; the mechanics are the engine's).

- Take: a sample interrupted with `keep: snapshot` (rollout `on_quota`, abort `keep`).
- Reuse (`kv: auto`, and rollouts resuming buffered samples): only a snapshot taken under the
  current weight version, unless the server allows stale reuse (`--april-allow-stale-kv`) and
  the caller's `max_staleness` covers the version lag. `kv: restore` insists (409 otherwise);
  `kv: recompute` never restores.
- Drop: once a sample finishes, restarts, is dropped or deleted. A snapshot evicted by the
  store's LRU simply isn't there: the continuation re-prefills and its segment says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from april_server.engine_base import BaseEngine, SnapshotEngine
from april_server.protocol import KvMode, Sample
from april_server.samples import version_lag


class SnapshotPolicy:
    def __init__(self, engine: BaseEngine, allow_stale: bool) -> None:
        self.engine: SnapshotEngine | None = None
        if isinstance(engine, SnapshotEngine) and engine.snapshots_enabled:
            self.engine = engine
        self.allow_stale = allow_stale

    @property
    def enabled(self) -> bool:
        return self.engine is not None

    def usable(
        self,
        sample: Sample,
        current: str,
        history: Sequence[str],
        max_staleness: int | None,
    ) -> bool:
        if self.engine is None or sample.snapshot_bytes <= 0:
            return False
        version = sample.snapshot_weight_version
        if version == current:
            return True
        if not self.allow_stale or max_staleness is None or version is None:
            return False
        return version_lag(version, current, history) <= max_staleness

    def mark(self, rid: str, sample: Sample) -> None:
        if self.engine is not None:
            self.engine.mark_snapshot(rid, sample.sample_id)

    async def restore(self, sample: Sample, mode: KvMode, usable: bool) -> int:
        if self.engine is None or mode == "recompute" or not usable:
            return 0
        return await self.engine.restore_snapshot(sample.sample_id)

    async def after_segment(
        self, sample: Sample, restored: int, interrupted: bool, wanted: bool, marked: bool
    ) -> None:
        """Release what the restore held; record the new snapshot or forget any old one.
        `marked`: a snapshot was requested for this segment, so the scheduler may hold one
        even if the caller changed its mind (a later abort with another `keep`)."""
        if self.engine is None:
            return
        if restored:
            await self.engine.release_snapshot(sample.sample_id)
        info = None
        if interrupted and wanted:
            info = await self.engine.snapshot_info(sample.sample_id)
        if info is None:
            await self.forget(sample, force=marked)
        else:
            sample.snapshot_bytes = int(info["bytes"])
            sample.snapshot_weight_version = (
                sample.segments[-1].weight_version if sample.segments else None
            )

    async def forget(self, sample: Sample, force: bool = False) -> None:
        if self.engine is not None and (force or sample.snapshot_bytes > 0):
            await self.engine.drop_snapshot(sample.sample_id)
        sample.snapshot_bytes = 0
        sample.snapshot_weight_version = None

    async def refresh(self, samples: Sequence[Sample]) -> None:
        """Clear the figures of snapshots the store has evicted since."""
        if self.engine is None:
            return
        for s in samples:
            if s.snapshot_bytes > 0 and await self.engine.snapshot_info(s.sample_id) is None:
                s.snapshot_bytes = 0
                s.snapshot_weight_version = None
