"""`SchedulerKv.on_restore` over fake pools (run in a subprocess by test_scheduler_hooks.py: it
imports SGLang, which is slow and stubs sgl_kernel process-wide). Exit 0 = OK.

Checks (#23): a restore that fails after allocating gives every slot back; a restore into a
namespace inserts and matches with that namespace as the radix key's `extra_key`. And the host
budget is split over TP ranks too, their byte figures reported for the whole. And the envelope
SGLang dispatches (`AprilKvReq`) gets an error reply, not an exception, for a body that holds
no operation."""

from __future__ import annotations

import sys
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import torch


class Allocator:
    page_size = 1

    def __init__(self) -> None:
        self.free_slots = set(range(100))

    def alloc(self, n: int) -> torch.Tensor:
        got = sorted(self.free_slots)[:n]
        self.free_slots -= set(got)
        return torch.tensor(got, dtype=torch.int32)

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots |= set(slots.tolist())


class Tree:
    disable = False

    def __init__(self) -> None:
        self.inserted: list[Any] = []

    def match_prefix(self, params: Any) -> Any:
        hit = any(k.extra_key == params.key.extra_key for k in self.inserted)
        return SimpleNamespace(device_prefix_len=4 if hit else 0, last_device_node=1)

    def insert(self, params: Any) -> None:
        self.inserted.append(params.key)

    def lock(self, node: Any) -> str:
        return "lock"

    def unlock(self, lock: Any) -> None:
        pass

    def evict(self, params: Any) -> None:
        pass


def main() -> int:
    from sglang.test.test_utils import maybe_stub_sgl_kernel

    maybe_stub_sgl_kernel()
    from april_server.door.channel import Restore
    from april_server.door.scheduler_hooks import SchedulerKv

    kv = SchedulerKv.__new__(SchedulerKv)
    alloc, tree = Allocator(), Tree()
    kv.sched = SimpleNamespace(token_to_kv_pool_allocator=alloc, tree_cache=tree)
    kv.locks = {}
    kv.marked = OrderedDict()
    kv.store = SimpleNamespace(get=lambda key: SimpleNamespace(tokens=[5, 6, 7, 8]))

    def broken_fill(*args: Any) -> None:
        raise RuntimeError("copy failed half-way")

    kv._fill = broken_fill  # type: ignore[method-assign]
    try:
        kv.on_restore(Restore(key="s/0"))
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failing restore did not raise")
    assert alloc.free_slots == set(range(100)), "a failed restore leaked KV slots"
    assert tree.inserted == [] and kv.locks == {}

    kv._fill = lambda *args: None  # type: ignore[method-assign]
    ok, payload = kv.on_restore(Restore(key="s/0", namespace="april-stale/s/0"))
    assert ok and payload["restored"] == 4, payload
    assert [k.extra_key for k in tree.inserted] == ["april-stale/s/0"]

    # --april-kv-host-bytes is the whole server's with TP too (review of 2026-12-06: each of
    # T TP ranks held the whole DP share, T x the budget, and /stats showed one shard).
    from april_server.door.scheduler_hooks import host_budget, whole_dp_rank

    assert host_budget(8 << 30, 2, 4) == 1 << 30 and host_budget(100, 1, 1) == 100
    assert whole_dp_rank({"snapshot_bytes_used": 10, "snapshots": 3}, 4) == {
        "snapshot_bytes_used": 40,
        "snapshots": 3,
    }
    check_envelope()
    print("scheduler kv check OK")
    return 0


def check_envelope() -> None:
    """The message SGLang's dispatcher hands `handle`, both ways, with a good and a bad body."""
    import json

    import msgspec

    from april_server.door.channel import Info, encode
    from april_server.door.ipc import AprilKvReq, AprilKvResp
    from april_server.door.scheduler_hooks import SchedulerKv

    kv = SchedulerKv.__new__(SchedulerKv)
    kv.dp_rank, kv.rank0, kv.tp = 0, True, 1
    kv.store = SimpleNamespace(info=lambda key: {"tokens": 3, "bytes": 12})
    kv.handlers = kv.handler_table()
    resp = kv.handle(AprilKvReq(call_id=7, body=encode(Info(key="s/0"))))
    assert isinstance(resp, AprilKvResp) and resp.call_id == 7 and resp.ok, resp
    assert json.loads(resp.payload) == {"tokens": 3, "bytes": 12}
    bad = kv.handle(AprilKvReq(call_id=8, body=msgspec.msgpack.encode({"op": "nope"})))
    assert bad is not None and not bad.ok and bad.call_id == 8, bad
    assert "not a scheduler operation" in json.loads(bad.payload)["error"], bad.payload
    assert kv.handle(AprilKvReq(call_id=9, body=b"", dp_rank=1)) is None  # another rank's


if __name__ == "__main__":
    sys.exit(main())
