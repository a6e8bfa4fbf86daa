"""What the server needs from an inference engine (the segment runner drives it; the inflight
policy reads its capacity and step curve); `door/engine.py` is the SGLang one.

Tests plug in a fake with the same interface, so the bookkeeping is tested without SGLang.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from april_client.protocol import RoutingDtype, WeightGroupInfo
from april_server.rules.inflight import EngineCapacity, StepStat
from april_server.rules.placement import Slot
from april_server.rules.samples import SegmentResult

MAX_MARKED = 100_000


@dataclass(frozen=True, slots=True)
class SegmentCall:
    """One segment to run, as planned (`placement.plan_segment`)."""

    rid: str
    key: str  # the sample's snapshot key (its sample id)
    input_ids: list[int]
    sampling_params: dict[str, Any]
    slot: Slot
    restore: bool = False  # restore `key`'s snapshot on `slot` first
    drop: Slot | None = None  # free `key`'s snapshot held there first
    # Restore into, and generate within, this prefix-cache namespace (`snapshots.py`).
    cache_ns: str | None = None
    # Return the routed experts from this context position on (None: don't); a restore moves
    # it to the restore point, which recomputes nothing before it (rules/routing_replay.py).
    routing_start: int | None = None
    # Return each generated token's sampling mask (rules/sampling_mask.py).
    sampling_mask: bool = False


@dataclass(frozen=True, slots=True)
class SegmentOutcome:
    result: SegmentResult
    slot: Slot  # where it ran
    restored: int = 0  # snapshot tokens made visible to prefix matching before it ran
    # Bytes of the snapshot `slot` holds for `key` after a marked request ended by abort
    # (None: not asked, or none taken).
    snapshot_bytes: int | None = None


class EngineUnavailable(RuntimeError):
    """The engine holding `slot` is gone (dead or unreachable) before the segment ended: what
    it generated there is lost, and so is every snapshot it held. The segment may run again
    on another slot."""

    def __init__(self, slot: Slot, why: str) -> None:
        super().__init__(f"engine {slot.engine} unavailable: {why}")
        self.slot = slot


def ran_on(planned: Slot, result: SegmentResult) -> Slot:
    """Where a segment ran: the engine's own report wins over the plan."""
    if result.dp_rank is None or result.dp_rank == planned.dp_rank:
        return planned
    return Slot(planned.engine, result.dp_rank)


class BaseEngine(ABC):
    context_len: int
    vocab_size: int | None
    # Seeded mode: the engine gives every unseeded request the same default seed, so the
    # server assigns one per group (else all members of a group would be identical).
    assigns_seeds: bool = False
    # Token ids that end generation unless `ignore_eos` (the model's EOS): how a segment that
    # ended by abort in the step that produced one is known to have finished (`stops.py`).
    eos_token_ids: frozenset[int] = frozenset()
    # (MoE layers, top_k, dtype) of the routed experts it returns; None: it returns none.
    routing_format: tuple[int, int, RoutingDtype] | None = None
    # The most token ids a sampling-mask row may hold (SGLang's --sampling-mask-max-tokens);
    # None: it returns no sampling masks.
    sampling_mask_tokens: int | None = None

    @abstractmethod
    def weight_version(self) -> str:
        """The version of the weights that new tokens are generated with."""

    def weight_group(self) -> WeightGroupInfo:
        """The ranks a trainer's weight-update group needs here and the group they are in."""
        return WeightGroupInfo(ranks=1, weight_version=self.weight_version())

    @abstractmethod
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; raises ApiError(400) when the server has no tokenizer.
        `special=False`: no special tokens added (a tool's answer goes mid-context; a BOS
        there would be a token the model never sees in the trainer's own encoding)."""

    def detokenize(self, ids: list[int]) -> str | None:
        """The text of `ids` (None when the server has no tokenizer)."""
        return None

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

    def slots(self) -> list[Slot]:
        """Where segments can run (one per data-parallel rank)."""
        return [Slot()]

    def healthy(self, slot: Slot) -> bool:
        return True

    def capacity_key(self) -> object:
        """What the engine's capacity depends on: when it changes, the admission bound is
        sized again (an owner's healthy engines). Fixed for one server."""
        return None

    async def generate_on(self, slot: Slot, call: SegmentCall) -> SegmentResult:
        """`generate` pinned to `slot` (an engine with one slot ignores it)."""
        return await self.generate(call.rid, call.input_ids, call.sampling_params)

    async def run_segment(self, call: SegmentCall) -> SegmentOutcome:
        """Perform a planned segment: one call from the segment runner, whatever it takes."""
        result = await self.generate_on(call.slot, call)
        return SegmentOutcome(result, ran_on(call.slot, result))

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

    Keys are sample ids: one snapshot per sample, replaced by each new interruption. A
    snapshot lives on the slot (DP rank) whose request it was taken from; every operation
    names that slot."""

    snapshots_enabled: bool = True

    def _marked(self) -> OrderedDict[str, None]:
        # Lazily: test doubles mix this class with engines that do not call its __init__.
        marked: OrderedDict[str, None] = self.__dict__.setdefault("_marked_rids", OrderedDict())
        return marked

    def mark_snapshot(self, rid: str, key: str, slot: Slot) -> None:
        """Snapshot `rid`'s KV under `key` if it ends by abort. Must be ordered before the
        abort that ends it (both go down the same channel)."""
        marked = self._marked()
        marked[rid] = None
        while len(marked) > MAX_MARKED:  # marks that raced their request's end
            marked.popitem(last=False)
        self.send_mark(rid, key, slot)

    async def run_segment(self, call: SegmentCall) -> SegmentOutcome:
        """Drop the unused snapshot, restore the used one, generate on its slot, let the
        restore go, and say what a marked, aborted request left behind."""
        if call.drop is not None:
            await self.drop_snapshot(call.key, call.drop)
        restored = 0
        if call.restore:
            restored = await self.restore_snapshot(call.key, call.slot, call.cache_ns)
        if restored and call.routing_start is not None:
            # Nothing before the restore point is computed again, and the input's last token
            # always is: a snapshot longer than the input (taken after what the sample's body
            # recorded, which a commit that failed leaves behind) stops at it.
            call = replace(call, routing_start=min(restored, len(call.input_ids) - 1))
        try:
            result = await self.generate_on(call.slot, call)
        finally:
            if restored:
                await self.release_snapshot(call.key, call.slot)
        slot = ran_on(call.slot, result)
        nbytes = None
        marked = self._marked()
        if call.rid in marked:
            del marked[call.rid]
            if result.finish_reason == "abort":
                info = await self.snapshot_info(call.key, slot)
                nbytes = None if info is None else int(info["bytes"])
        return SegmentOutcome(result, slot, restored, nbytes)

    @abstractmethod
    def send_mark(self, rid: str, key: str, slot: Slot) -> None:
        """Tell `slot` to snapshot `rid` under `key` when it ends by abort."""

    @abstractmethod
    async def restore_snapshot(self, key: str, slot: Slot, namespace: str | None = None) -> int:
        """Make the snapshot visible to prefix matching (within `namespace`, if given: only
        requests naming it match) and hold it; returns the tokens made visible (0: nothing
        usable, the continuation will re-prefill)."""

    @abstractmethod
    async def release_snapshot(self, key: str, slot: Slot) -> None:
        """Let go of what `restore_snapshot` holds (after the continuation has matched it)."""

    @abstractmethod
    async def drop_snapshot(self, key: str, slot: Slot) -> None:
        """Free the host copy."""

    @abstractmethod
    async def snapshot_info(self, key: str, slot: Slot) -> dict[str, Any] | None:
        """{"tokens", "bytes"} of a live snapshot, None if absent (never taken or evicted)."""

    async def snapshot_keys(self) -> dict[Slot, dict[str, float]]:
        """Every snapshot held, by slot: key -> age in seconds (`snapshot_sweep.py` frees
        the ones nobody refers to). Empty: this engine cannot list them (nothing is swept)."""
        return {}

    @abstractmethod
    async def snapshot_stats(self) -> dict[str, Any]:
        """Store and pool figures: bytes used/budget, evictions, GB/s, free pool tokens
        (summed over slots, with a per-rank breakdown where there are several)."""
