"""Host snapshot store: byte budget, LRU eviction, accounting that never drifts."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from april_server.kv_store import HostKvStore, Snapshot


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
