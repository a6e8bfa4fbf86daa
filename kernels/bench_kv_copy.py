"""KV snapshot save/restore bandwidth beside a measured copy ceiling. Not a test.

    python -m kernels.bench_kv_copy [--device cuda|cpu] [--quick] [--json-out FILE]
    python -m kernels.bench_kv_copy --check      # bit-exact Triton/torch vs reference on CUDA
    TRITON_INTERPRET=1 python -m kernels.bench_kv_copy --check --tiny   # the same, CPU, small

GB/s counts the KV bytes moved once (2 * layers * tokens * row bytes). Columns: "ceiling" is a
plain copy of the same bytes in the same run (pinned device->host / host->device on CUDA, a
memcpy-like ``copy_`` on CPU); "torch" is ``backend="torch"`` (index_select/index_copy_ per
layer); "triton" is the one-launch kernel writing pinned host memory directly (CUDA only: the
CPU interpreter is not a serving path); "sglang" is ``MHATokenToKVPool.get_cpu_copy`` /
``load_cpu_copy`` when SGLang can build a pool here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from kernels.kv_copy import (
    page_slot_ids,
    restore_kv,
    restore_kv_ref,
    save_kv,
    save_kv_ref,
)
from kernels.kv_copy_triton import interpreting

# (num_layers, num_kv_heads, head_dim), bf16 KV as served.
MODELS = {"Qwen3-4B": (36, 8, 128), "Llama-3.1-8B": (32, 8, 128)}
TOKENS = (128, 1024, 4096, 16384)
QUICK_TOKENS = (128, 1024)
PAGE_SIZE = 16
METHODS = ("ceiling", "torch", "triton", "sglang")


def _time_ms(fn: Callable[[], object], device: str, quick: bool) -> float:
    """Median milliseconds per call."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])[0])
    fn()  # warm-up: first-touch page faults would otherwise dominate
    times = []
    for _ in range(5 if quick else 9):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _sglang_pool(num_layers: int, heads: int, head_dim: int, size: int, device: str):
    """(pool, None) with SGLang's MHATokenToKVPool, or (None, reason)."""
    try:
        from sglang.test.test_utils import maybe_stub_sgl_kernel, published_topology

        maybe_stub_sgl_kernel()
        with published_topology(device=device, page_size=PAGE_SIZE):
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

            pool = MHATokenToKVPool(
                size=size,
                page_size=PAGE_SIZE,
                dtype=torch.bfloat16,
                head_num=heads,
                head_dim=head_dim,
                layer_num=num_layers,
                device=device,
                enable_memory_saver=False,
            )
        return pool, None
    except Exception as exc:  # any failure only drops the sglang column
        return None, f"{type(exc).__name__}: {exc}"


def _host_empty(shape, dtype, device: str) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=device == "cuda")


def _fits_host_ram(num_tokens: int, shape: tuple[int, int, int]) -> bool:
    """CPU runs hold the pool (2x tokens) plus ~5 slab-sized buffers; keep under 70% of RAM."""
    num_layers, heads, head_dim = shape
    slab = 2 * num_layers * num_tokens * heads * head_dim * 2
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return 7 * slab < 0.7 * free


def _bench_model(name: str, shape: tuple[int, int, int], tokens, device, quick, notes):
    num_layers, heads, head_dim = shape
    if device == "cpu":
        skipped = [t for t in tokens if not _fits_host_ram(t, shape)]
        tokens = [t for t in tokens if t not in skipped]
        if skipped:
            notes.append(f"{name}: tokens {skipped} skipped, not enough free host RAM")
    max_tokens = max(tokens)
    size = 2 * math.ceil(max_tokens / PAGE_SIZE) * PAGE_SIZE + PAGE_SIZE  # save + restore slots
    pool, reason = _sglang_pool(num_layers, heads, head_dim, size, device)
    if pool is None:
        notes.append(f"sglang column skipped: {reason}")
        rows = size + PAGE_SIZE
        k = [torch.zeros(rows, heads, head_dim, dtype=torch.bfloat16, device=device)]
        k = k + [torch.zeros_like(k[0]) for _ in range(num_layers - 1)]
        v = [torch.zeros_like(k[0]) for _ in range(num_layers)]
    else:
        k, v = pool.k_buffer, pool.v_buffer
    for buf in k + v:
        buf.fill_(1.0)  # touch every page once; values do not matter for a copy

    results = []
    for num_tokens in tokens:
        row = _bench_tokens(k, v, pool, num_tokens, device, quick)
        results.append({"model": name, **row})
        print(_format_row(results[-1]), flush=True)
    return results


def _bench_tokens(k, v, pool, num_tokens: int, device: str, quick: bool) -> dict:
    """One table row: GB/s per method and direction (None where the method is excluded)."""
    num_pages = k[0].shape[0] // PAGE_SIZE
    need = math.ceil(num_tokens / PAGE_SIZE)
    pages = torch.randperm(num_pages - 1)[: 2 * need] + 1  # page 0 is SGLang's padding
    src = page_slot_ids(pages[:need], PAGE_SIZE, num_tokens).to(device)
    dst = page_slot_ids(pages[need:], PAGE_SIZE, num_tokens).to(device)
    slab = _host_empty((2, len(k), num_tokens, *k[0].shape[1:]), k[0].dtype, device)
    nbytes = slab.numel() * slab.element_size()
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = _host_empty(nbytes, torch.uint8, device)

    fns: dict[str, tuple[Callable[[], object], Callable[[], object]] | None] = {
        "ceiling": (
            lambda: flat_host.copy_(flat_dev, non_blocking=True),
            lambda: flat_dev.copy_(flat_host, non_blocking=True),
        ),
        "torch": (
            lambda: save_kv(k, v, src, slab, backend="torch"),
            lambda: restore_kv(k, v, dst, slab, backend="torch"),
        ),
        "triton": None,
        "sglang": None,
    }
    if device == "cuda":
        fns["triton"] = (
            lambda: save_kv(k, v, src, slab, backend="triton"),
            lambda: restore_kv(k, v, dst, slab, backend="triton"),
        )
    if pool is not None:
        cpu_copy = pool.get_cpu_copy(src)
        fns["sglang"] = (
            lambda: pool.get_cpu_copy(src),
            lambda: pool.load_cpu_copy(cpu_copy, dst),
        )
    row: dict = {"tokens": num_tokens, "MiB": nbytes / 2**20}
    for method, pair in fns.items():
        for op, fn in zip(("save", "restore"), pair or (None, None), strict=True):
            row[f"{method} {op}"] = (
                nbytes / (_time_ms(fn, device, quick) * 1e-3) / 1e9 if fn else None
            )
    return row


def _format_row(row: dict) -> str:
    cells = [row["model"], str(row["tokens"]), f"{row['MiB']:.1f}"]
    for method in METHODS:
        for op in ("save", "restore"):
            value = row[f"{method} {op}"]
            cells.append("—" if value is None else f"{value:.1f}")
    return "| " + " | ".join(cells) + " |"


def _header() -> str:
    names = ["model", "tokens", "MiB"] + [
        f"{m} {op}" for m in METHODS for op in ("save", "restore")
    ]
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def _random_pool(num_layers, rows, heads, head_dim, dtype, device):
    """(k_buffers, v_buffers) of random bytes, NaN payloads included."""
    width = head_dim * torch.empty(0, dtype=dtype).element_size()

    def buf():
        raw = torch.randint(0, 256, (rows, heads, width), dtype=torch.uint8, device=device)
        return raw.view(dtype)

    return [buf() for _ in range(num_layers)], [buf() for _ in range(num_layers)]


def _check_case(device, dtype, num_tokens, page_size, heads, head_dim, backend, host_slab) -> bool:
    num_pages = 2 * math.ceil(max(num_tokens, 1) / page_size) + 2
    k, v = _random_pool(3, num_pages * page_size, heads, head_dim, dtype, device)
    need = math.ceil(num_tokens / page_size)
    pages = torch.randperm(num_pages - 1)[: 2 * need] + 1
    src = page_slot_ids(pages[:need], page_size, num_tokens).to(device)
    dst = page_slot_ids(pages[need:], page_size, num_tokens).to(device)
    # host_slab: let save_kv allocate (pinned host on CUDA); else a slab on the pool's device.
    shape = (2, 3, num_tokens, heads, head_dim)
    out = None if host_slab else torch.empty(shape, dtype=dtype, device=device)

    snap = save_kv(k, v, src, out, backend=backend)
    expected_k, expected_v = [b.clone() for b in k], [b.clone() for b in v]
    expected_snap = save_kv_ref(k, v, src)
    restore_kv_ref(expected_k, expected_v, dst, expected_snap)
    restore_kv(k, v, dst, snap, backend=backend)
    if device == "cuda":
        torch.cuda.synchronize()
    ok = torch.equal(snap.cpu().view(torch.uint8), expected_snap.cpu().view(torch.uint8))
    for now, want in zip(k + v, expected_k + expected_v, strict=True):
        ok = ok and torch.equal(now.view(torch.uint8), want.view(torch.uint8))
    return ok


def run_check(device: str, tiny: bool = False) -> int:
    """Bit-exact save/restore against the references on ``device``; returns failures.
    ``tiny``: a few small cases (seconds in the CPU interpreter), both kernel paths."""
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]
    # On CPU the Triton path is only checked under the interpreter (slow: minutes).
    backends = ["triton", "torch"] if device == "cuda" or interpreting() else ["torch"]
    host_slabs = (True, False) if device == "cuda" else (False,)
    tokens, pages = ((1, 33), (16,)) if tiny else ((0, 1, 7, 33, 1000, 4099), (1, 16))
    # (8, 128): rows of 1024 elements, the aligned (vector) path; (3, 5): the unaligned one.
    heads = ((2, 16), (3, 5)) if tiny else ((8, 128), (3, 5))
    grid = itertools.product(dtypes, tokens, pages, heads, backends, host_slabs)
    cases = failures = 0
    for dtype, num_tokens, page_size, (heads, head_dim), backend, host_slab in grid:
        cases += 1
        if not _check_case(
            device, dtype, num_tokens, page_size, heads, head_dim, backend, host_slab
        ):
            failures += 1
            print(
                f"FAIL {dtype} tokens={num_tokens} page={page_size} heads={heads}x{head_dim} "
                f"backend={backend} pinned_host_slab={host_slab}"
            )
    print(f"check on {device}: {cases} cases, {failures} failures")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cuda", "cpu"], default=default_device)
    parser.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS} only")
    parser.add_argument("--json-out", help="also write the rows as JSON to this file")
    parser.add_argument("--check", action="store_true", help="bit-exact checks, no timing")
    parser.add_argument("--tiny", action="store_true", help="with --check: a few small cases")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    torch.manual_seed(0)
    if args.check:
        return 1 if run_check(args.device, args.tiny) else 0

    tokens = QUICK_TOKENS if args.quick else TOKENS
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# KV save/restore GB/s on {name} (bf16, page {PAGE_SIZE}, random whole pages)\n")
    print(_header(), flush=True)
    notes: list[str] = []
    results = []
    for model, shape in MODELS.items():
        results += _bench_model(model, shape, tokens, args.device, args.quick, notes)
    if args.device != "cuda":
        notes.append("triton column skipped: CPU runs Triton only in the interpreter")
    if notes:
        print()
    for note in dict.fromkeys(notes):
        print(f"- {note}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": name, "rows": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
