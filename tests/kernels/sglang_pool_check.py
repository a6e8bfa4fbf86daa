"""Cross-check kernels/kv_copy.py against SGLang's own MHATokenToKVPool on CPU.

Run by tests/kernels/test_kv_copy.py::test_against_sglang_mha_pool in a subprocess (sglang's
import is slow, warns, and stubs sgl_kernel process-wide). Exit 0 = OK, 3 = cannot run here
(message on the last stdout line), anything else = failure.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kernels.kv_copy import mha_kv_buffers, restore_kv, save_kv  # noqa: E402

PAGE_SIZE = 16
POOL_SIZE = 256  # tokens; SGLang adds one padding page in front
NUM_TOKENS = 37  # two full pages and a partial one
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _check_dtype(pool_cls, allocator_cls, dtype: torch.dtype) -> None:
    pool = pool_cls(
        size=POOL_SIZE,
        page_size=PAGE_SIZE,
        dtype=dtype,
        head_num=2,
        head_dim=12,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = allocator_cls(POOL_SIZE, PAGE_SIZE, dtype, "cpu", pool, need_sort=False)
    k, v = mha_kv_buffers(pool)
    for buf in k + v:  # random bytes, viewed as whatever SGLang stores (uint8 for fp8)
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape))

    pages = -(-NUM_TOKENS // PAGE_SIZE) * PAGE_SIZE
    src = allocator.alloc(pages)[:NUM_TOKENS].to(torch.int64)
    dst = allocator.alloc(pages)[:NUM_TOKENS].to(torch.int64)
    assert not set(src.tolist()) & set(dst.tolist())

    snap = save_kv(k, v, src, backend="triton")
    theirs = pool.get_cpu_copy(src)  # [layer][chunk] -> [k_rows, v_rows]
    for layer in range(3):
        for kv in range(2):
            rows = torch.cat([chunk[kv] for chunk in theirs[layer]])
            assert torch.equal(snap[kv, layer].view(torch.uint8), rows.view(torch.uint8)), (
                dtype,
                layer,
                kv,
            )

    before = [b.clone() for b in k + v]
    restore_kv(k, v, dst, snap, backend="triton")
    untouched = torch.ones(k[0].shape[0], dtype=torch.bool)
    untouched[dst] = False
    restored = pool.get_cpu_copy(dst)
    for layer in range(3):
        for kv in range(2):
            rows = torch.cat([chunk[kv] for chunk in restored[layer]])
            assert torch.equal(rows.view(torch.uint8), snap[kv, layer].view(torch.uint8))
    for now, was in zip(k + v, before, strict=True):
        assert torch.equal(now[untouched].view(torch.uint8), was[untouched].view(torch.uint8))

    # And the other direction: SGLang's load_cpu_copy into fresh slots, read back by ours.
    third = allocator.alloc(pages)[:NUM_TOKENS].to(torch.int64)
    pool.load_cpu_copy(theirs, third)
    again = save_kv(k, v, third, backend="triton")
    assert torch.equal(again.view(torch.uint8), snap.view(torch.uint8))
    print(f"{dtype}: store {k[0].dtype}, {NUM_TOKENS} tokens at page {PAGE_SIZE}: OK")


def main() -> int:
    try:
        from sglang.test.test_utils import maybe_stub_sgl_kernel, published_topology

        maybe_stub_sgl_kernel()
        with published_topology(device="cpu", page_size=PAGE_SIZE):
            from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    except ImportError as exc:
        print(f"sglang not importable here: {exc}")
        return 3

    with published_topology(device="cpu", page_size=PAGE_SIZE):
        for dtype in DTYPES:
            _check_dtype(MHATokenToKVPool, PagedTokenToKVPoolAllocator, dtype)
        mla = MLATokenToKVPool(
            size=POOL_SIZE,
            page_size=PAGE_SIZE,
            dtype=torch.bfloat16,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
        try:
            mha_kv_buffers(mla)
        except NotImplementedError as exc:
            assert "MLA" in str(exc), exc
            print(f"MLATokenToKVPool refused: {exc}")
        else:
            raise AssertionError("mha_kv_buffers accepted an MLA pool")
    print("sglang pool check OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
