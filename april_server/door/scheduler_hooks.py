"""Scheduler-process side of KV snapshots, installed through SGLang's plugin hooks.

Entry point `sglang.srt.plugins: april = april_server.door.scheduler_hooks:register` (see
pyproject.toml); `april-server` sets `SGLANG_PLUGINS=april`. Hooks, each a short wrapper:
- AFTER `Scheduler.init_request_dispatcher`: route `AprilKvReq` to `SchedulerKv.handle`, which
  answers the operation it carries (`channel.py`) with the method its handler table names.
- AROUND `mem_cache.common.release_kv_cache`: before SGLang frees a request that ended by
  abort and was marked for a snapshot, gather its committed KV into the host store.
- AFTER `Scheduler.flush_cache`: a flush drops the whole tree, so our tree locks go with it.
- AROUND `Scheduler.run_batch`: decode step times by batch size (the in-flight policy's curve)
  and seconds spent per forward kind (where the engine's time goes, `/stats` `engine_time`).
- AROUND `Scheduler.on_idle`: seconds the scheduler had no batch to run (waiting for work),
  which splits the time outside forwards into the engine idling and its own scheduling.
With `--dp-size N` each rank has its own `SchedulerKv` (its share of the host budget, its
snapshots); SGLang's DP controller broadcasts our messages, and only the addressed rank acts.
"""

from __future__ import annotations

import json
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from april_server.door.channel import (
    Clock,
    Curve,
    Drop,
    Info,
    Keys,
    Mark,
    Reply,
    Restore,
    SchedulerOp,
    Stats,
    Unlock,
    answer,
)
from april_server.door.deterministic import register_deterministic_hooks
from april_server.door.dp_hooks import register_dp_hooks
from april_server.door.fault_hooks import register_fault_hooks
from april_server.door.kv_store import HostKvStore
from april_server.door.moe_hooks import register_moe_hooks, restore_routing, saved_routing
from april_server.engine.clock import EngineClock, StepTimer
from april_server.settings import env
from kernels.kv_copy import mha_kv_buffers, restore_kv, save_kv

if TYPE_CHECKING:  # SGLang is imported where the hooks run, not by importing this module
    from april_server.door.ipc import AprilKvReq, AprilKvResp

logger = logging.getLogger(__name__)

MAX_MARKED = 100_000  # marks whose request ended without an abort are forgotten oldest-first
_active: SchedulerKv | None = None  # one scheduler per process; the release hook needs it


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register_deterministic_hooks()  # no-op off SGLang's CPU engine; see door/deterministic.py
    register_dp_hooks()  # the DP controller's idle loop, on SGLang's CPU engine: dp_hooks.py
    register_fault_hooks()  # tests only: off unless APRIL_FAULT_INJECTION=1 (fault_hooks.py)
    register_moe_hooks()  # routed-experts capture without CUDA; no-op on GPU (moe_hooks.py)

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher",
        _after_init_dispatcher,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.common.release_kv_cache", _around_release, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.flush_cache", _after_flush, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_batch", _around_run_batch, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.on_idle", _around_on_idle, HookType.AROUND
    )


def _after_init_dispatcher(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.utils import TypeBasedDispatcher

    from april_server.door.ipc import AprilKvReq

    global _active
    _active = SchedulerKv(scheduler)
    scheduler._request_dispatcher += TypeBasedDispatcher([(AprilKvReq, _active.handle)])
    return result


def _around_release(original: Any, req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> Any:
    kv = _active
    if kv is not None:
        key = kv.marked.pop(req.rid, None)
        if key is not None and kv.ended_by_abort(req):
            try:
                kv.save(key, req, tree_cache)
            except Exception:  # a failed snapshot means recompute, never a broken release
                logger.exception("april: snapshot of %s failed", req.rid)
    return original(req, tree_cache, *args, **kwargs)


def _after_flush(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    if _active is not None and getattr(result, "success", result):
        _active.locks.clear()  # the tree they pointed into is gone
    return result


def _around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kw: Any) -> Any:
    if _active is None:
        return original(scheduler, batch, *args, **kw)
    t0 = time.perf_counter()
    result = original(scheduler, batch, *args, **kw)
    try:  # measurement must never break a step
        # After the call: SGLang fills the batch's `seq_lens_sum` inside run_batch.
        _active.steps.on_batch(batch, started_at=t0)
        _active.clock.add(batch, time.perf_counter() - t0)
    except Exception:
        logger.exception("april: engine timing failed")
    return result


def _around_on_idle(original: Any, scheduler: Any, *args: Any, **kw: Any) -> Any:
    if _active is None:
        return original(scheduler, *args, **kw)
    t0 = time.perf_counter()
    try:
        return original(scheduler, *args, **kw)
    finally:
        _active.clock.add_idle(time.perf_counter() - t0)


def dp_position() -> tuple[int, int]:
    """(this scheduler's data-parallel rank, the number of ranks); (0, 1) without DP."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    rank = parallel.dp_rank
    return (0 if rank is None else int(rank)), max(1, int(parallel.num_dp_ranks))


def host_budget(total_bytes: int, dp_size: int, tp_size: int) -> int:
    """One scheduler's share of --april-kv-host-bytes, which is the whole server's: each DP
    rank holds its share, split again over its TP ranks (each saves its shard of the heads)."""
    return total_bytes // (max(1, dp_size) * max(1, tp_size))


# Figures in bytes that TP rank 0 (the one that answers) holds for itself only.
_SHARDED = ("bytes", "snapshot_bytes_used", "snapshot_bytes_budget", "pinned_bytes",
            "pinned_free_bytes")  # fmt: skip


def whole_dp_rank(figures: dict[str, Any], tp_size: int) -> dict[str, Any]:
    """TP rank 0's byte figures scaled to its whole DP rank (the shards are equal)."""
    return {k: v * tp_size if k in _SHARDED else v for k, v in figures.items()}


class SchedulerKv:
    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.dp_rank, dp_size = dp_position()
        # Every TP rank of a DP rank saves its own shard of the heads, the same size on each.
        self.tp = max(1, int(getattr(scheduler, "tp_size", 1) or 1))
        self.store = HostKvStore(host_budget(env.kv_host_bytes(), dp_size, self.tp))
        self.marked: OrderedDict[str, str] = OrderedDict()  # rid -> snapshot key
        self.locks: dict[str, Any] = {}  # key -> TreeLock holding a restored prefix
        self.rank0 = getattr(scheduler, "tp_rank", 0) == 0
        self.steps = StepTimer()
        self.clock = EngineClock()
        self.handlers = self.handler_table()

    # ---- messages ----------------------------------------------------------------------------

    def handler_table(self) -> dict[type[SchedulerOp], Callable[[Any], Reply]]:
        """Every operation of the channel and the method that answers it."""
        return {
            Mark: self.on_mark,
            Restore: self.on_restore,
            Unlock: self.on_unlock,
            Drop: self.on_drop,
            Info: self.on_info,
            Keys: self.on_keys,
            Stats: self.on_stats,
            Curve: self.on_curve,
            Clock: self.on_clock,
        }

    def handle(self, req: AprilKvReq) -> AprilKvResp | None:
        from april_server.door.ipc import AprilKvResp

        # SGLang's DP controller broadcasts our messages to every rank: only the addressed
        # one acts (all of them for -1), and each answer says whose it is.
        if req.dp_rank >= 0 and req.dp_rank != self.dp_rank:
            return None
        ok, payload = answer(self.handlers, req.body)
        if not self.rank0:
            return None  # control replies come from TP rank 0 only
        return AprilKvResp(
            call_id=req.call_id, ok=ok, payload=json.dumps(payload), dp_rank=self.dp_rank
        )

    def on_mark(self, op: Mark) -> Reply:
        self.marked[op.rid] = op.key
        while len(self.marked) > MAX_MARKED:
            self.marked.popitem(last=False)
        return True, {}

    def on_drop(self, op: Drop) -> Reply:
        self._unlock(op.key)
        return self.store.drop(op.key), {}

    def on_info(self, op: Info) -> Reply:
        info = self.store.info(op.key)
        return info is not None, whole_dp_rank(info or {}, self.tp)

    def on_keys(self, op: Keys) -> Reply:
        return True, {"keys": self.store.ages()}

    def on_stats(self, op: Stats) -> Reply:
        tree = self.sched.tree_cache
        return True, {
            **whole_dp_rank(self.store.stats(), self.tp),
            "free_tokens": int(self.sched.token_to_kv_pool_allocator.available_size()),
            "evictable_tokens": int(tree.evictable_size()),
            "protected_tokens": int(tree.protected_size()),
            "restore_locks": len(self.locks),
            "pending_marks": len(self.marked),
            # What the engine runs at once: the admission bound is sized from it
            # (`rules/inflight.py`, `Admission`).
            "max_running_requests": int(self.sched.max_running_requests),
            "max_total_tokens": int(self.sched.max_total_num_tokens),
        }

    def on_curve(self, op: Curve) -> Reply:
        return True, self.steps.curve()

    def on_clock(self, op: Clock) -> Reply:
        return True, self.clock.snapshot()

    def on_unlock(self, op: Unlock) -> Reply:
        return self._unlock(op.key), {}

    def _unlock(self, key: str) -> bool:
        lock = self.locks.pop(key, None)
        if lock is not None:
            self.sched.tree_cache.unlock(lock)
        return lock is not None

    def on_restore(self, op: Restore) -> Reply:
        """Make the snapshot's prefix visible to SGLang's prefix matching and hold it (tree
        lock) until `Unlock`, so the continuation request matches it instead of prefilling."""
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixKey

        snap = self.store.get(op.key)
        if snap is None:
            return False, {"reason": "no snapshot (never taken, evicted or dropped)"}
        alloc, tree = self.sched.token_to_kv_pool_allocator, self.sched.tree_cache
        if getattr(tree, "disable", False):
            # No radix cache (--disable-radix-cache, deterministic mode): nothing could match
            # or own the restored slots, so they would leak. The continuation re-prefills.
            return False, {"reason": "the radix cache is disabled"}
        page = int(alloc.page_size)
        n = len(snap.tokens) - len(snap.tokens) % page  # the radix tree keys whole pages only
        if n == 0:
            return False, {"reason": "shorter than one page"}
        # A stale snapshot goes into its continuation's own namespace (`snapshots.py`).
        key = RadixKey(array("q", snap.tokens[:n]), op.namespace or None)
        match = tree.match_prefix(MatchPrefixParams(key=key))
        copied = 0
        if match.device_prefix_len < n:
            slots = alloc.alloc(n)
            if slots is None:
                tree.evict(EvictParams(num_tokens=n))
                slots = alloc.alloc(n)
            if slots is None:
                return False, {"reason": "no free KV slots"}
            slots = slots.to(torch.int64)
            try:
                self._fill(slots, snap, n)
            except BaseException:
                alloc.free(slots)  # nobody owns them yet: a failed restore must not leak
                raise
            # The tree adopts the slots. A review read SGLang 0.5.23's RadixCache.insert as
            # leaving those that duplicate a prefix it holds to the caller; freeing them here
            # made chaos crash the scheduler on its idle pool check (one slot counted twice),
            # so this stays as it was until a test on the real tree settles it.
            tree.insert(InsertParams(key=key, value=slots))
            copied = n
            match = tree.match_prefix(MatchPrefixParams(key=key))
        old = self.locks.pop(op.key, None)
        if old is not None:
            tree.unlock(old)
        self.locks[op.key] = tree.lock(match.last_device_node)
        return True, {"restored": int(match.device_prefix_len), "copied": copied}

    def _fill(self, slots: Any, snap: Any, n: int) -> None:
        """Write the snapshot's first `n` tokens of K/V into freshly allocated `slots`."""
        snap.wait()
        kv = snap.head(n)  # pinned when the snapshot is: a CUDA restore needs that
        k_bufs, v_bufs = mha_kv_buffers(self.sched.token_to_kv_pool_allocator.get_kvcache())
        t0 = time.perf_counter()
        restore_kv(k_bufs, v_bufs, slots, kv)
        if slots.is_cuda:
            torch.cuda.current_stream().synchronize()
        self.store.restore.add(int(kv.numel() * kv.element_size()), time.perf_counter() - t0)
        restore_routing(slots, snap.routing, n)

    # ---- snapshot on release -----------------------------------------------------------------

    @staticmethod
    def ended_by_abort(req: Any) -> bool:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        return isinstance(req.finished_reason, FINISH_ABORT) and bool(req.kv.holds_kv)

    def save(self, key: str, req: Any, tree_cache: Any) -> None:
        # The newest token's KV is not written yet (it is the next step's input).
        n = min(int(req.kv.kv_committed_len), len(req.origin_input_ids) + len(req.output_ids) - 1)
        if n <= 0:
            return
        slots = tree_cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
        slots = slots.to(torch.int64)
        k_bufs, v_bufs = mha_kv_buffers(tree_cache.token_to_kv_pool_allocator.get_kvcache())
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[:n]
        # CUDA: into a pooled pinned slab on a side stream ordered after the forward that wrote
        # this KV, finished before SGLang frees the slots (kv_store.py). CPU: a plain copy.
        self.store.save_snapshot(
            key,
            tokens,
            lambda out: save_kv(k_bufs, v_bufs, slots, out),
            shape=(2, len(k_bufs), n, *k_bufs[0].shape[1:]),
            dtype=k_bufs[0].dtype,
            device=slots.device,
            uses=(slots,),
            routing=saved_routing(slots),
        )
