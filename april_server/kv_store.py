"""Host-side store of KV snapshots, one per interrupted sample, with a byte budget and LRU.

Lives in the scheduler process (each tensor-parallel rank keeps its own shard). An evicted or
missing snapshot is never an error: the continuation re-prefills. Volatile by design: a
restart loses every snapshot (the token state is what is durable).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Snapshot:
    tokens: list[int]  # the context ids whose KV `kv` holds, in order
    kv: torch.Tensor  # [2, num_layers, num_tokens, num_kv_heads, head_dim], pool dtype
    created_at: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        return int(self.kv.numel() * self.kv.element_size())


@dataclass
class Throughput:
    """GB/s of the last and of all copies (bytes / seconds, summed)."""

    last_gbps: float = 0.0
    total_bytes: int = 0
    total_s: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        seconds = max(seconds, 1e-9)
        self.last_gbps = nbytes / seconds / 1e9
        self.total_bytes += nbytes
        self.total_s += seconds

    @property
    def mean_gbps(self) -> float:
        return self.total_bytes / self.total_s / 1e9 if self.total_s else 0.0


class HostKvStore:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._snaps: OrderedDict[str, Snapshot] = OrderedDict()
        self.bytes_used = 0
        self.evicted = 0
        self.rejected = 0
        self.save = Throughput()
        self.restore = Throughput()

    def __contains__(self, key: str) -> bool:
        return key in self._snaps

    def __len__(self) -> int:
        return len(self._snaps)

    def put(self, key: str, snap: Snapshot) -> bool:
        """Keep `snap` under `key` (replacing an older one), evicting least recently used
        snapshots to fit. False when it alone exceeds the budget (then nothing is kept)."""
        self.drop(key)
        if snap.nbytes > self.budget_bytes:
            self.rejected += 1
            return False
        while self.bytes_used + snap.nbytes > self.budget_bytes:
            _, old = self._snaps.popitem(last=False)
            self.bytes_used -= old.nbytes
            self.evicted += 1
        self._snaps[key] = snap
        self.bytes_used += snap.nbytes
        return True

    def get(self, key: str) -> Snapshot | None:
        snap = self._snaps.get(key)
        if snap is not None:
            self._snaps.move_to_end(key)
        return snap

    def drop(self, key: str) -> bool:
        snap = self._snaps.pop(key, None)
        if snap is None:
            return False
        self.bytes_used -= snap.nbytes
        return True

    def info(self, key: str) -> dict[str, Any] | None:
        snap = self._snaps.get(key)
        if snap is None:
            return None
        return {"tokens": len(snap.tokens), "bytes": snap.nbytes}

    def stats(self) -> dict[str, Any]:
        live = sum(s.nbytes for s in self._snaps.values())
        assert live == self.bytes_used, (live, self.bytes_used)
        return {
            "snapshots": len(self._snaps),
            "snapshot_bytes_used": self.bytes_used,
            "snapshot_bytes_budget": self.budget_bytes,
            "snapshots_evicted": self.evicted,
            "snapshots_rejected": self.rejected,
            "save_gbps_last": round(self.save.last_gbps, 4),
            "save_gbps_mean": round(self.save.mean_gbps, 4),
            "restore_gbps_last": round(self.restore.last_gbps, 4),
            "restore_gbps_mean": round(self.restore.mean_gbps, 4),
        }
