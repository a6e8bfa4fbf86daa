"""Host snapshot store: byte budget, LRU eviction, accounting that never drifts; the pinned
slab pool and the CUDA save path, with the CUDA stream and events faked (no device here)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from april_server.door.kv_store import HostKvStore, SlabPool, Snapshot, size_class


def snap(num_tokens: int) -> Snapshot:
    # [2, layers=2, tokens, heads=2, dim=4] fp32 = 128 bytes per token
    return Snapshot(tokens=list(range(num_tokens)), kv=torch.zeros(2, 2, num_tokens, 2, 4))


def _assert_bytes_match(store: HostKvStore) -> None:
    assert store.stats()["snapshot_bytes_used"] == store.bytes_used <= store.budget_bytes


def test_lru_evicts_least_recently_used() -> None:
    store = HostKvStore(budget_bytes=128 * 10)
    assert store.put("a", snap(4)) and store.put("b", snap(4))
    assert store.get("a") is not None  # a is now the most recent
    assert store.put("c", snap(4))  # 12 tokens > 10: b goes
    assert "b" not in store and "a" in store and "c" in store
    assert store.evicted == 1
    _assert_bytes_match(store)


def test_too_big_is_refused_not_an_error() -> None:
    store = HostKvStore(budget_bytes=128)
    assert store.put("small", snap(1))
    assert not store.put("big", snap(2))
    assert store.rejected == 1 and "big" not in store and "small" in store


def test_replace_same_key() -> None:
    store = HostKvStore(budget_bytes=128 * 10)
    store.put("a", snap(3))
    store.put("a", snap(5))
    assert len(store) == 1 and store.bytes_used == 128 * 5
    assert store.info("a") == {"tokens": 5, "bytes": 640}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "get", "drop"]), st.integers(0, 5), st.integers(0, 6)),
        max_size=60,
    )
)
def test_random_ops_keep_accounting_exact(ops: list[tuple[str, int, int]]) -> None:
    store = HostKvStore(budget_bytes=128 * 12)
    for op, key, n in ops:
        k = f"k{key}"
        if op == "put":
            store.put(k, snap(n))
        elif op == "get":
            store.get(k)
        else:
            store.drop(k)
        _assert_bytes_match(store)


# ---- pinned slab pool and the CUDA save path, on CPU with fakes ------------------------------


class FakeEvent:
    """A CUDA event stand-in: done when told, or once waited for."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


class FakeSideStream:
    """SideStream stand-in: runs the copy at once; its event finishes only when waited for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses: list[tuple[torch.Tensor, ...]] = []
        self.fences: list[FakeEvent] = []

    def run(self, fn, uses):
        fn()
        self.uses.append(tuple(uses))
        return FakeEvent(), lambda: 0.5

    def fence(self) -> FakeEvent:
        self.fences.append(FakeEvent())
        return self.fences[-1]


CUDA = torch.device("cuda")  # only a label here: the side stream is faked
SHAPE_PER_TOKEN = (2, 2, 1, 2, 4)  # fp32: 128 bytes per token, as snap()


def pageable(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def cuda_store(budget_tokens: int, min_class: int = 64) -> HostKvStore:
    pool = SlabPool(budget_tokens * 128 * 5 // 4, allocate=pageable, min_class_bytes=min_class)
    return HostKvStore(budget_bytes=128 * budget_tokens, pool=pool, side_stream=FakeSideStream)


def save_cuda(store: HostKvStore, key: str, num_tokens: int, seen: list | None = None) -> bool:
    source = torch.randn(2, 2, num_tokens, 2, 4)

    def copy(out):
        assert out is not None, "the CUDA path must hand the copy a pooled slab"
        if seen is not None:
            seen.append(out)
        return out.copy_(source)

    shape = (2, 2, num_tokens, 2, 4)
    kept = store.save_snapshot(
        key, list(range(num_tokens)), copy, shape=shape, dtype=torch.float32, device=CUDA
    )
    if kept:
        assert torch.equal(store.get(key).kv, source)
    return kept


def test_size_class_rounds_up_by_less_than_a_quarter():
    for n in [*range(1, 3000), 2**20, 2**20 + 1, 3 * 2**30 + 7]:
        size = size_class(n, 64)
        assert size >= max(n, 64)
        assert n < 64 or size < 1.25 * n or size == n
    assert size_class(10, 2**16) == 2**16
    assert [size_class(n, 1) for n in (512, 513, 641, 769, 897)] == [512, 640, 768, 896, 1024]


def test_pool_reuses_a_released_buffer_of_the_same_class():
    pool = SlabPool(10_000, allocate=pageable, min_class_bytes=64)
    first = pool.acquire(1000)
    pool.release(first)
    again = pool.acquire(900)  # same class (1024)
    assert again is first
    assert (pool.allocations, pool.reuses) == (1, 1)
    other = pool.acquire(3000)  # another class: a new buffer
    assert other is not first and other.numel() == 3072 and pool.allocations == 2


def test_pool_keeps_a_buffer_until_the_copy_into_it_is_done():
    pool = SlabPool(10_000, allocate=pageable, min_class_bytes=64)
    busy = pool.acquire(1000)
    copying = FakeEvent()
    pool.release(busy, copying)
    assert pool.stats()["pinned_pending"] == 1
    fresh = pool.acquire(1000)
    assert fresh is not busy  # the copy may still write `busy`
    copying.done = True
    assert pool.acquire(1000) is busy
    assert pool.stats()["pinned_pending"] == 0


def test_pool_gives_free_buffers_back_to_stay_under_capacity_then_refuses():
    pool = SlabPool(1024, allocate=pageable, min_class_bytes=64)
    small = pool.acquire(512)
    pool.release(small)
    big = pool.acquire(1024)  # only fits once the free 512-byte buffer is given back
    assert big is not None and pool.held_bytes == 1024
    assert pool.acquire(64) is None and pool.exhausted == 1
    pool.release(big)
    assert pool.acquire(64) is not None and pool.held_bytes == 64


def test_cuda_path_copies_into_a_pooled_slab_and_waits_before_returning():
    store = cuda_store(budget_tokens=10)
    seen: list[torch.Tensor] = []
    slots = torch.arange(4)
    source = torch.randn(2, 2, 4, 2, 4)

    def copy(out):
        seen.append(out)
        return out.copy_(source)

    kept = store.save_snapshot(
        "a",
        [1, 2, 3, 4],
        copy,
        shape=(2, 2, 4, 2, 4),
        dtype=torch.float32,
        device=CUDA,
        uses=(slots,),
    )
    snap = store.get("a")
    assert kept and snap is not None and snap.kv is seen[0]
    assert snap.slab is not None and snap.kv.data_ptr() == snap.slab.data_ptr()
    # The request's KV slots are freed by SGLang right after: the copy must be over by then.
    assert snap.ready.waited == 1
    assert store._side_streams[CUDA].uses == [(slots,)]
    assert store.save.total_bytes == 512 and store.save.total_s == 0.5
    assert store.pinned_stats()["slab_allocations"] == 1


def test_evicted_snapshots_give_their_slab_to_the_next_one():
    store = cuda_store(budget_tokens=8)
    seen: list[torch.Tensor] = []
    assert save_cuda(store, "a", 4, seen) and save_cuda(store, "b", 4, seen)
    assert save_cuda(store, "c", 4, seen)  # evicts a, whose slab it then reuses
    assert "a" not in store and store.evicted == 1
    assert seen[2].data_ptr() == seen[0].data_ptr()
    stats = store.pinned_stats()
    assert (stats["slab_allocations"], stats["slab_reuses"]) == (2, 1)
    store.drop("b")
    assert store.pinned_stats()["pinned_free_bytes"] == 512
    _assert_bytes_match(store)


def test_cuda_snapshot_replacing_its_key_reuses_its_slab_and_evicts_nothing():
    store = cuda_store(budget_tokens=8)
    seen: list[torch.Tensor] = []
    assert save_cuda(store, "a", 4, seen) and save_cuda(store, "b", 4, seen)
    store.get("a")  # b is now the least recently used
    assert save_cuda(store, "a", 4, seen)
    assert "b" in store and store.evicted == 0
    assert seen[2].data_ptr() == seen[0].data_ptr()
    assert store.pinned_stats()["slab_allocations"] == 2


def test_cuda_snapshot_over_budget_is_refused_before_any_copy():
    store = cuda_store(budget_tokens=4)
    assert save_cuda(store, "a", 2)
    assert not save_cuda(store, "big", 5)  # copy() would fail if it ran: it must not
    assert store.rejected == 1 and "a" in store and store.pinned_stats()["slab_allocations"] == 1


def test_failed_copy_returns_its_slab_only_once_the_side_stream_is_past_it():
    store = cuda_store(budget_tokens=8)

    def broken(out):
        raise ValueError("bad slot ids")

    with pytest.raises(ValueError, match="bad slot"):
        store.save_snapshot(
            "a", [1], broken, shape=(2, 2, 1, 2, 4), dtype=torch.float32, device=CUDA
        )
    assert "a" not in store and store.bytes_used == 0
    assert store.pinned_stats()["pinned_pending"] == 1
    store._side_streams[CUDA].fences[0].done = True
    assert save_cuda(store, "b", 1)
    assert store.pinned_stats()["slab_reuses"] == 1


def test_cpu_path_is_the_old_one():
    # Old scheduler hook: slab = save_kv(...) (allocates); put; on success count the bytes.
    kv = torch.randn(2, 2, 3, 2, 4)
    got = []

    def copy(out):
        got.append(out)
        return kv

    store = HostKvStore(budget_bytes=128 * 10)
    assert store.save_snapshot(
        "a", [1, 2, 3], copy, shape=tuple(kv.shape), dtype=kv.dtype, device=torch.device("cpu")
    )
    assert got == [None]  # the copy allocates its own slab, as before
    snap = store.get("a")
    assert snap.kv is kv and snap.slab is None and snap.ready is None
    assert store.pool is None and store.pinned_stats() == {}
    assert store.save.total_bytes == kv.numel() * 4
    big = torch.zeros(2, 2, 11, 2, 4)
    assert not store.save_snapshot(
        "b",
        [0] * 11,
        lambda out: big,
        shape=tuple(big.shape),
        dtype=big.dtype,
        device=torch.device("cpu"),
    )
    assert store.rejected == 1 and store.save.total_bytes == kv.numel() * 4


def test_head_is_a_contiguous_prefix():
    snapshot = Snapshot(tokens=[1, 2, 3], kv=torch.randn(2, 2, 3, 2, 4))
    assert snapshot.head(3) is snapshot.kv
    head = snapshot.head(2)
    assert head.is_contiguous() and torch.equal(head, snapshot.kv[:, :, :2])
    snapshot.wait()  # no event on CPU: nothing to wait for


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["save", "get", "drop"]), st.integers(0, 5), st.integers(1, 9)),
        max_size=40,
    )
)
def test_pool_and_store_agree_on_every_slab(ops: list[tuple[str, int, int]]) -> None:
    store = cuda_store(budget_tokens=12, min_class=128)
    for op, key, n in ops:
        k = f"k{key}"
        if op == "save":
            save_cuda(store, k, n)
        elif op == "get":
            store.get(k)
        else:
            store.drop(k)
        _assert_bytes_match(store)
        live = [store.get(f"k{i}") for i in range(6)]
        slabs = [s.slab for s in live if s is not None]
        assert all(s is not None for s in slabs)
        assert len({s.data_ptr() for s in slabs}) == len(slabs)  # never lent twice
        stats = store.pool.stats()
        lent = sum(s.numel() for s in slabs)
        assert stats["pinned_bytes"] == lent + stats["pinned_free_bytes"]  # nothing pending
        assert stats["pinned_bytes"] <= store.pool.capacity_bytes
        assert stats["slab_pool_exhausted"] == 0  # the 25 % headroom always suffices


def test_routing_beside_the_kv_counts_in_the_budget_and_goes_with_it() -> None:
    # 128 bytes of KV + [tokens, layers=2, top_k=2] int32 = 16 bytes of routing per token
    def moe_snap(n: int) -> Snapshot:
        s = snap(n)
        s.routing = torch.zeros(n, 2, 2, dtype=torch.int32)
        return s

    store = HostKvStore(budget_bytes=144 * 10)
    assert store.put("a", moe_snap(4)) and store.put("b", moe_snap(4))
    stats = store.stats()
    assert stats["snapshot_bytes_used"] == 144 * 8 and stats["snapshot_routing_bytes"] == 16 * 8
    assert stats["snapshot_tokens"] == 8 and store.info("a") == {
        "tokens": 4,
        "bytes": 576,
        "routing_bytes": 64,
    }
    assert store.put("c", moe_snap(4))  # 12 x 144 bytes > the budget: the oldest goes
    assert "a" not in store and store.stats()["snapshot_routing_bytes"] == 16 * 8
    store.drop("b")
    store.drop("c")
    assert store.stats()["snapshot_routing_bytes"] == 0 == store.bytes_used
