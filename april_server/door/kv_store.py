"""Host-side store of KV snapshots, one per interrupted sample, with a byte budget and LRU.

Lives in the scheduler process (each tensor-parallel rank keeps its own shard). An evicted or
missing snapshot is never an error: the continuation re-prefills. Volatile by design: a
restart loses every snapshot (the token state is what is durable).

On CUDA (``save_snapshot`` with a CUDA device) a snapshot lives in page-locked host memory
taken from a ``SlabPool`` of slabs reused by size class: pinning memory (cudaHostAlloc) is
slow and serializes with the device, so it must not happen per snapshot. The device-to-host
copy runs on a side stream, after the work already queued on the current stream (the forward
pass that wrote the KV); ``save_snapshot`` returns only once the copy has finished, because
SGLang frees the request's pool slots right after and may hand them to the next forward. A
slab goes back to the pool when its snapshot is dropped or evicted, and is reused only once
the copy that filled it is known complete. On CPU the copy allocates its own slab: nothing to
pin, no stream to order after.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class ReadyEvent(Protocol):
    """What a snapshot needs of a ``torch.cuda.Event``: is the copy done, wait for it."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class Snapshot:
    tokens: list[int]  # the context ids whose KV `kv` holds, in order
    kv: torch.Tensor  # [2, num_layers, num_tokens, num_kv_heads, head_dim], pool dtype
    created_at: float = field(default_factory=time.time)
    slab: torch.Tensor | None = None  # pooled pinned buffer `kv` views (None: kv owns memory)
    ready: ReadyEvent | None = None  # CUDA copies only: completes when `kv` has been filled
    # MoE with routed-experts capture: the experts each token was routed to when its KV was
    # computed, [num_tokens, num_moe_layers, top_k] int32 on the host (None: not captured).
    routing: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return int(self.kv.numel() * self.kv.element_size()) + self.routing_bytes

    @property
    def routing_bytes(self) -> int:
        r = self.routing
        return 0 if r is None else int(r.numel() * r.element_size())

    def wait(self) -> None:
        """Block until the copy that filled ``kv`` has finished (no-op on CPU)."""
        if self.ready is not None:
            self.ready.synchronize()

    def head(self, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` tokens' KV as one contiguous [2, L, n, H, D] slab; pinned
        when the snapshot came from a CUDA pool (which restores from pinned host memory only)."""
        if num_tokens == self.kv.shape[2]:
            return self.kv
        part = self.kv[:, :, :num_tokens]
        out = torch.empty(part.shape, dtype=part.dtype, pin_memory=self.ready is not None)
        return out.copy_(part)


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


def size_class(nbytes: int, min_bytes: int) -> int:
    """Slab size for a request: the smallest m * 2^e >= nbytes with m in 4..8, so a slab
    wastes under 25 % of itself, and at least ``min_bytes`` (small snapshots share a class)."""
    n = max(nbytes, min_bytes, 1)
    shift = max(n.bit_length() - 3, 0)
    return next(m << shift for m in (4, 5, 6, 7, 8) if (m << shift) >= n)


def pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class SlabPool:
    """Page-locked host buffers (uint8, one size class each), lent out and taken back.

    ``capacity_bytes`` bounds every buffer the pool holds, lent or free; to make room it gives
    free buffers back first. A buffer returned with an unfinished ``ready`` event waits in
    ``pending`` until the event completes, so no copy can still be writing a reused buffer.
    """

    def __init__(
        self,
        capacity_bytes: int,
        allocate: Callable[[int], torch.Tensor] = pinned_bytes,
        min_class_bytes: int = 1 << 16,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.min_class_bytes = min_class_bytes
        self._allocate = allocate
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: list[tuple[torch.Tensor, ReadyEvent]] = []
        self.held_bytes = 0  # every buffer allocated and not given back: lent, free, pending
        self.allocations = 0
        self.reuses = 0
        self.exhausted = 0

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A free buffer of at least ``nbytes`` (its size class), reused if one is free, or None
        when the capacity does not allow one."""
        self._collect()
        size = size_class(nbytes, self.min_class_bytes)
        free = self._free.get(size)
        if free:
            self.reuses += 1
            return free.pop()
        while self.held_bytes + size > self.capacity_bytes and self._give_back_one():
            pass
        if self.held_bytes + size > self.capacity_bytes:
            self.exhausted += 1
            return None
        buf = self._allocate(size)
        self.held_bytes += size
        self.allocations += 1
        return buf

    def release(self, buf: torch.Tensor, ready: ReadyEvent | None = None) -> None:
        """Take ``buf`` back; reusable once ``ready`` (if any) has completed."""
        if ready is not None and not ready.query():
            self._pending.append((buf, ready))
        else:
            self._free.setdefault(buf.numel(), []).append(buf)

    def stats(self) -> dict[str, int]:
        free = sum(b.numel() for bufs in self._free.values() for b in bufs)
        return {
            "pinned_bytes": self.held_bytes,
            "pinned_free_bytes": free,
            "pinned_pending": len(self._pending),
            "slab_allocations": self.allocations,
            "slab_reuses": self.reuses,
            "slab_pool_exhausted": self.exhausted,
        }

    def _collect(self) -> None:
        still = []
        for buf, ready in self._pending:
            if ready.query():
                self._free.setdefault(buf.numel(), []).append(buf)
            else:
                still.append((buf, ready))
        self._pending = still

    def _give_back_one(self) -> bool:
        """Free the largest free buffer (most room for one release of page-locked memory)."""
        sizes = [size for size, bufs in self._free.items() if bufs]
        if not sizes:
            return False
        size = max(sizes)
        self._free[size].pop()
        self.held_bytes -= size
        return True


class SideStream:
    """Runs device-to-host copies on a side CUDA stream, timed with CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def run(
        self, fn: Callable[[], None], uses: Sequence[torch.Tensor]
    ) -> tuple[ReadyEvent, Callable[[], float]]:
        """Queue ``fn`` after everything queued so far on the current stream. Returns the
        event that completes with it and a function giving its seconds once it has."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        done = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):
            for t in uses:  # made on the current stream: keep the allocator off them meanwhile
                t.record_stream(self.stream)
            start.record()
            fn()
            done.record()
        return done, lambda: start.elapsed_time(done) / 1e3

    def fence(self) -> ReadyEvent:
        """An event that completes once everything queued on the side stream so far has."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event


class HostKvStore:
    def __init__(
        self,
        budget_bytes: int,
        pool: SlabPool | None = None,
        side_stream: Callable[[torch.device], Any] = SideStream,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._snaps: OrderedDict[str, Snapshot] = OrderedDict()
        self.bytes_used = 0
        self.evicted = 0
        self.rejected = 0
        self.save = Throughput()
        self.restore = Throughput()
        # Pinned slabs, made on the first CUDA save with a capacity 25 % over the budget: a
        # slab rounds its snapshot up by less than that, so the live snapshots fit (unless
        # many are under the 64 KiB smallest slab; past capacity a save pins its own slab).
        self.pool = pool
        self._make_side_stream = side_stream
        self._side_streams: dict[torch.device, Any] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._snaps

    def __len__(self) -> int:
        return len(self._snaps)

    def put(self, key: str, snap: Snapshot) -> bool:
        """Keep `snap` under `key` (replacing an older one), evicting least recently used
        snapshots to fit. False when it alone exceeds the budget (then nothing is kept)."""
        self.drop(key)
        if not self.make_room(snap.nbytes):
            self.rejected += 1
            return False
        self._snaps[key] = snap
        self.bytes_used += snap.nbytes
        return True

    def make_room(self, nbytes: int) -> bool:
        """Evict least recently used snapshots until ``nbytes`` more fit the budget. False (and
        nothing evicted) when ``nbytes`` alone exceeds it."""
        if nbytes > self.budget_bytes:
            return False
        while self.bytes_used + nbytes > self.budget_bytes:
            _, old = self._snaps.popitem(last=False)
            self._forget(old)
            self.evicted += 1
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
        self._forget(snap)
        return True

    def save_snapshot(
        self,
        key: str,
        tokens: list[int],
        copy: Callable[[torch.Tensor | None], torch.Tensor],
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        uses: Sequence[torch.Tensor] = (),
        routing: torch.Tensor | None = None,
    ) -> bool:
        """Snapshot a request's KV under ``key``. ``copy(out)`` writes the KV of ``device`` into
        the host slab ``out`` of ``shape``/``dtype`` and returns it; with ``out=None`` it
        allocates the slab itself. ``uses``: device tensors ``copy`` reads (kept alive for the
        side stream). ``routing``: the tokens' routed experts (host memory, kept beside the KV
        and counted in the budget). False when the snapshot was not kept (too big for the
        budget)."""
        if device.type != "cuda":  # CPU: nothing to pin; the copy allocates, the store keeps it
            t0 = time.perf_counter()
            slab = copy(None)
            snap = Snapshot(tokens=tokens, kv=slab, routing=routing)
            return self._keep(key, snap, time.perf_counter() - t0)
        extra = 0 if routing is None else int(routing.numel() * routing.element_size())
        nbytes = math.prod(shape) * dtype.itemsize + extra
        self.drop(key)  # its slab may serve the new snapshot
        if not self.make_room(nbytes):
            self.rejected += 1
            return False
        if self.pool is None:
            self.pool = SlabPool(self.budget_bytes + self.budget_bytes // 4)
        # None when the pool is exhausted: then `copy` pins a slab of its own (slow, but rare).
        buf = self.pool.acquire(nbytes)
        out = None if buf is None else buf[:nbytes].view(dtype).view(shape)
        side = self._side_stream(device)
        result: list[torch.Tensor] = []
        try:
            done, seconds = side.run(lambda: result.append(copy(out)), uses)
            # SGLang frees (or re-caches) the request's pool slots as soon as the caller
            # returns, and the next forward may write them: they must have been read by then.
            done.synchronize()
        except BaseException:
            if buf is not None:  # reusable once whatever was queued before the error is done
                self.pool.release(buf, side.fence())
            raise
        snap = Snapshot(tokens=tokens, kv=result[0], slab=buf, ready=done, routing=routing)
        kept = self._keep(key, snap, seconds())
        if not kept and buf is not None:
            self.pool.release(buf, done)
        return kept

    def pinned_stats(self) -> dict[str, int]:
        """The pinned slab pool's figures (empty before the first CUDA save)."""
        return {} if self.pool is None else self.pool.stats()

    def info(self, key: str) -> dict[str, Any] | None:
        snap = self._snaps.get(key)
        if snap is None:
            return None
        info = {"tokens": len(snap.tokens), "bytes": snap.nbytes}
        return info if snap.routing is None else {**info, "routing_bytes": snap.routing_bytes}

    def ages(self) -> dict[str, float]:
        """Every key held, with its snapshot's age in seconds (for the owner's sweep)."""
        now = time.time()
        return {k: round(now - s.created_at, 3) for k, s in self._snaps.items()}

    def stats(self) -> dict[str, Any]:
        live = sum(s.nbytes for s in self._snaps.values())
        assert live == self.bytes_used, (live, self.bytes_used)
        return {
            "snapshots": len(self._snaps),
            "snapshot_bytes_used": self.bytes_used,
            "snapshot_bytes_budget": self.budget_bytes,
            # Tokens held, and of the bytes used the routed experts kept beside their KV (MoE
            # capture only): routing bytes per snapshot token = the one over the other.
            "snapshot_tokens": sum(len(s.tokens) for s in self._snaps.values()),
            "snapshot_routing_bytes": sum(s.routing_bytes for s in self._snaps.values()),
            "snapshots_evicted": self.evicted,
            "snapshots_rejected": self.rejected,
            "save_gbps_last": round(self.save.last_gbps, 4),
            "save_gbps_mean": round(self.save.mean_gbps, 4),
            "restore_gbps_last": round(self.restore.last_gbps, 4),
            "restore_gbps_mean": round(self.restore.mean_gbps, 4),
            **self.pinned_stats(),  # CUDA: the pinned slabs snapshots are copied into
        }

    def _keep(self, key: str, snap: Snapshot, seconds: float) -> bool:
        if not self.put(key, snap):
            return False
        self.save.add(snap.nbytes, seconds)
        return True

    def _forget(self, snap: Snapshot) -> None:
        self.bytes_used -= snap.nbytes
        if snap.slab is not None and self.pool is not None:
            self.pool.release(snap.slab, snap.ready)

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._side_streams:
            self._side_streams[device] = self._make_side_stream(device)
        return self._side_streams[device]
