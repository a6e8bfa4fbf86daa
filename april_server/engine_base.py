"""What the rollout manager needs from an inference engine; `engine.py` is the SGLang one.

Tests plug in a fake with the same interface, so the bookkeeping is tested without SGLang.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from april_server.inflight import EngineCapacity, StepStat
from april_server.samples import SegmentResult


class BaseEngine(ABC):
    context_len: int
    vocab_size: int | None
    # Seeded mode: the engine gives every unseeded request the same default seed, so the
    # server assigns one per group (else all members of a group would be identical).
    assigns_seeds: bool = False

    @abstractmethod
    def weight_version(self) -> str:
        """The version of the weights that new tokens are generated with."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`; raises ApiError(400) when the server has no tokenizer."""

    @abstractmethod
    def check_sampling_params(self, params: dict[str, Any]) -> None:
        """Raise ApiError(400) for sampling params the engine would reject."""

    @abstractmethod
    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        """Generate one segment. An abort ends it early with finish_reason "abort" and the
        tokens produced so far (never an exception)."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Ask the engine to stop `rid`. Fire and forget: a request the engine has not seen
        yet may miss it, so callers repeat until the generate call has returned."""

    async def step_curve(self) -> Mapping[int, float | StepStat]:
        """Seconds per decode step by running-batch size, as measured by the engine: a
        `StepStat` (count, mean, spread) or a bare mean (empty when it measures nothing: the
        in-flight policy then uses its prior)."""
        return {}

    async def capacity(self) -> EngineCapacity | None:
        """What the engine can run at once (None: it does not say; nothing bounds admission
        but the in-flight policy)."""
        return None

    async def engine_clock(self) -> dict[str, float]:
        """Cumulative engine seconds, batches and tokens by forward kind (`prefill_s`,
        `decode_s`, ...); empty when the engine does not measure them."""
        return {}

    def engine_stats(self) -> dict[str, Any]:
        """Engine-side figures for /stats (free KV tokens, running requests...)."""
        return {}


class SnapshotEngine(BaseEngine):
    """An engine that can keep an interrupted request's KV on the host and restore it.

    Keys are sample ids: one snapshot per sample, replaced by each new interruption."""

    snapshots_enabled: bool = True

    @abstractmethod
    def mark_snapshot(self, rid: str, key: str) -> None:
        """Snapshot `rid`'s KV under `key` if it ends by abort. Must be ordered before the
        abort that ends it (both go down the same channel)."""

    @abstractmethod
    async def restore_snapshot(self, key: str) -> int:
        """Make the snapshot visible to prefix matching and hold it; returns the tokens made
        visible (0: nothing usable, the continuation will re-prefill)."""

    @abstractmethod
    async def release_snapshot(self, key: str) -> None:
        """Let go of what `restore_snapshot` holds (after the continuation has matched it)."""

    @abstractmethod
    async def drop_snapshot(self, key: str) -> None:
        """Free the host copy."""

    @abstractmethod
    async def snapshot_info(self, key: str) -> dict[str, Any] | None:
        """{"tokens", "bytes"} of a live snapshot, None if absent (never taken or evicted)."""

    @abstractmethod
    async def snapshot_stats(self) -> dict[str, Any]:
        """Store and pool figures: bytes used/budget, evictions, GB/s, free pool tokens."""
