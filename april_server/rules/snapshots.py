"""When KV snapshots are taken, reused and dropped: pure rules (the acts are the engine's).

- Take: a sample interrupted with `keep: snapshot` (rollout `on_quota`, abort `keep`): the
  engine is asked to mark its request before the abort.
- Reuse (`kv: auto`, and rollouts resuming buffered samples): only a snapshot taken under the
  current weight version, unless the server allows stale reuse (`--april-allow-stale-kv`) and
  the caller's `max_staleness` covers the version lag. `kv: restore` insists (409 otherwise);
  `kv: recompute` never restores. Where it is restored is `placement.py`'s decision.
- Drop: once a sample finishes, restarts, is dropped or deleted, and when a continuation does
  not use it. A snapshot evicted by the store's LRU simply isn't there: the continuation
  re-prefills and its segment says so.

A snapshot lives where its segment ran (engine, DP rank); the server records that slot
(`engine/snapshot_places.py`), the sample only its size and weight version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from april_client.protocol import KvMode, Sample
from april_server.rules.samples import clear_snapshot, version_lag


def usable(
    sample: Sample,
    current: str,
    history: Sequence[str],
    max_staleness: int | None,
    allow_stale: bool,
) -> bool:
    """May a continuation of `sample` under weight version `current` restore its snapshot?"""
    if sample.snapshot_bytes <= 0:
        return False
    version = sample.snapshot_weight_version
    if version == current:
        return True
    if not allow_stale or max_staleness is None or version is None:
        return False
    return version_lag(version, current, history) <= max_staleness


def cache_namespace(sample: Sample, current: str) -> str | None:
    """The prefix-cache namespace a restore of `sample`'s snapshot goes into (SGLang's
    `extra_key`, which its continuation names too). A snapshot of older weights (stale reuse
    the caller allowed) gets one of its own: its pages must never serve another request with
    the same prefix, which did not ask for old-weights KV. A current one is shared (None)."""
    if sample.snapshot_weight_version == current:
        return None
    return f"april-stale/{sample.sample_id}"


def wants_restore(mode: KvMode, is_usable: bool, restarted: bool) -> bool:
    return mode != "recompute" and is_usable and not restarted


def record(sample: Sample, nbytes: int, restored: bool = False) -> None:
    """The snapshot the segment's abort left (where it lives is the server's own record,
    `engine/snapshot_places.py`). Tagged with the weights of the oldest KV in it: a segment
    that began from a restored snapshot of older weights (stale reuse, in its own namespace)
    carries that KV in its prefix, so its snapshot is as old, never current."""
    newest = sample.segments[-1].weight_version if sample.segments else None
    older = sample.snapshot_weight_version if restored else None
    sample.snapshot_bytes = nbytes
    sample.snapshot_weight_version = older if older is not None else newest


clear = clear_snapshot  # the sample holds no snapshot any more (samples.py)


def after_segment(
    snapshot_bytes: int | None, interrupted: bool, wanted: bool, marked: bool, restored: bool
) -> Literal["keep", "drop", "none"]:
    """What becomes of the segment slot's snapshot once the segment ended.
    `snapshot_bytes`: what the engine holds for the sample there (asked only after a marked
    request ended by abort); `marked`: a snapshot was requested, so the scheduler may hold one
    even if the caller changed its mind (a later abort with another `keep`); `restored`: the
    segment began from the snapshot, which is still held there."""
    if interrupted and wanted and snapshot_bytes:
        return "keep"
    if marked or restored or snapshot_bytes:
        return "drop"
    return "none"
