"""Every launch of the KV copy kernels, specialized exactly as a real GPU launch would be.

No device needed. The real launcher (``_launch`` of ``kernels/kv_copy_triton.py``, or of a
stand-in module with the same names) is called with a recorder in place of the kernel, on meta
tensors (no memory; a fresh one has address 0 and a view one element in has address itemsize,
as aligned and misaligned as the case needs); the recorded arguments then go
through Triton's own argument binder, so signature, ``tt.divisibility`` attributes and
constexprs are what ``kernel[grid](...)`` would compile on a GPU (16-aligned pointers and
multiples of 16 marked divisible, an int equal to 1 made a constant).

Must run with TRITON_INTERPRET unset: under the interpreter the kernels are not JITFunctions
and the launcher picks interpreter tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

ITEMSIZES = (1, 2, 4, 8)
KERNELS = {"save": "_kv_save_kernel", "restore": "_kv_restore_kernel"}
# Any value works for the tile choice; not a multiple of 16, so the JIT leaves it unmarked.
NUM_TOKENS = 1000
REAL_ROW = 1024  # 8 KV heads x head_dim 128 (Llama-3.1-8B, Qwen3-4B): the misaligned cases
_DTYPE_OF_ITEMSIZE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True)
class Launch:
    """One launch as the launcher makes it; ``case`` says how its memory is (mis)aligned."""

    kernel: str  # "save" | "restore"
    case: str  # aligned, row-/pool-/slab-unaligned, tokens-N, slots-offset, huge-pool
    itemsize: int
    row_elems: int
    num_tokens: int
    pool_rows: int
    block_tokens: int
    block_cols: int
    aligned: bool  # the ALIGNED constexpr the launcher chose
    args: tuple[Any, ...]  # what the launcher passed, tensors included
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def pool_align(self) -> int:
        """Bytes every pool row address is a multiple of (what a vector access may assume)."""
        return 16 if self.case == "slab-unaligned" else _row_align(self)

    @property
    def slab_align(self) -> int:
        return 16 if self.case == "pool-unaligned" else _row_align(self)

    @property
    def expect_vectors(self) -> bool:
        """Memory 16-byte aligned on both sides and rows of 16k elements: the aligned path,
        whatever the launcher decided (a launcher that stops choosing it must fail)."""
        return self.row_elems % 16 == 0 and self.pool_align == self.slab_align == 16

    @property
    def label(self) -> str:
        return (
            f"{self.kernel} {self.case} itemsize={self.itemsize} row={self.row_elems} "
            f"tokens={self.num_tokens} tile={self.block_tokens}x{self.block_cols}"
        )


def _row_align(launch: Launch) -> int:
    if launch.case in ("pool-unaligned", "slab-unaligned"):
        return launch.itemsize
    row_bytes = launch.row_elems * launch.itemsize
    return min(16, row_bytes & -row_bytes)  # largest power of two dividing the row size


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _pool(rows: int, row_elems: int, itemsize: int, shift: bool, device: str) -> torch.Tensor:
    """One pool buffer [rows, 1, row_elems]; ``shift`` starts it one element past an aligned
    address, so its base is not 16-byte aligned."""
    dtype = _DTYPE_OF_ITEMSIZE[itemsize]
    flat = torch.empty(rows * row_elems + int(shift), dtype=dtype, device=device)
    return flat[int(shift) :].view(rows, 1, row_elems)


def record_launch(
    module: ModuleType,
    kernel: str,
    case: str,
    itemsize: int,
    row_elems: int,
    num_tokens: int = NUM_TOKENS,
    *,
    num_layers: int = 1,
    pool_rows: int = 16,
    device: str = "meta",
) -> Launch:
    """Call the module's real launcher with a recorder; return the launch it made. (The
    launcher never sees the pool's size: only its buffers' addresses and row length.)"""
    shift_pool, shift_slab = case == "pool-unaligned", case == "slab-unaligned"
    buffers = [
        _pool(pool_rows, row_elems, itemsize, shift_pool, device) for _ in range(2 * num_layers)
    ]
    # "slots-offset": slot ids that are a view one element in, 8-byte but not 16-byte aligned
    # (as a slice of an allocator's free list would be).
    offset = int(case == "slots-offset")
    slots = torch.empty(num_tokens + offset, dtype=torch.int64, device=device)[offset:]
    slab = _pool(2 * num_layers * num_tokens, row_elems, itemsize, shift_slab, device)
    slab = slab.view(2, num_layers, num_tokens, 1, row_elems)
    recorder = _Recorder()
    module._launch(recorder, buffers, slots, slab, None, None)
    (_, args, kwargs) = recorder.calls[0]
    return Launch(
        kernel=kernel,
        case=case,
        itemsize=itemsize,
        row_elems=row_elems,
        num_tokens=num_tokens,
        pool_rows=pool_rows,
        block_tokens=kwargs["BLOCK_TOKENS"],
        block_cols=kwargs["BLOCK_COLS"],
        aligned=bool(kwargs["ALIGNED"]),
        args=args,
        kwargs=tuple(sorted(kwargs.items())),
    )


def tiles(module: ModuleType, itemsize: int, aligned: bool) -> dict[tuple[int, int], list[int]]:
    """Every (BLOCK_TOKENS, BLOCK_COLS) the launcher picks for this element width and path,
    with the row sizes that lead to it (aligned path: rows of 16k elements)."""
    # Rows past twice the widest column block all share its tile; 8k elements exceeds that.
    found: dict[tuple[int, int], list[int]] = {}
    for row in range(1, 8193):
        if (row % 16 == 0) == aligned:
            tile = module._geometry(row, itemsize, None, None, aligned)
            found.setdefault(tile, []).append(row)
    return found


def launches(
    module: ModuleType,
    kernels: tuple[str, ...] = tuple(KERNELS),
    itemsizes: tuple[int, ...] = ITEMSIZES,
) -> list[Launch]:
    """The launch set the AOT check compiles, per kernel and element width:

    - every aligned tile, at the longest row that picks it (rows of 16k elements, 16-byte
      aligned memory: what real KV pools get);
    - every unaligned tile, at the longest row that picks it (rows not of 16k elements);
    - a real row (1024 elements) with the pool, or the slab, one element off alignment;
    - the JIT's num_tokens specializations (== 1: a constant; a multiple of 16: divisible),
      and slot ids not 16-byte aligned (bf16, the real row).
    """
    out = []
    for kernel in kernels:
        for itemsize in itemsizes:
            for aligned, case in ((True, "aligned"), (False, "row-unaligned")):
                for rows in tiles(module, itemsize, aligned).values():
                    out.append(record_launch(module, kernel, case, itemsize, max(rows)))
            for case in ("pool-unaligned", "slab-unaligned"):
                out.append(record_launch(module, kernel, case, itemsize, REAL_ROW))
        if 2 in itemsizes:
            for tokens in (1, 4096):
                out.append(record_launch(module, kernel, f"tokens-{tokens}", 2, REAL_ROW, tokens))
            out.append(record_launch(module, kernel, "slots-offset", 2, REAL_ROW))
    return out


def huge_pool_launch(module: ModuleType, kernel: str) -> Launch:
    """An 80-layer bf16 pool of 2^21 + 16 rows x 1024 elements (2.1G elements per buffer) and a
    16k-token slab of 2.7G elements, on the meta device: beyond int32 on both sides."""
    return record_launch(
        module, kernel, "huge-pool", 2, REAL_ROW, 16384, num_layers=80, pool_rows=2**21 + 16
    )


@functools.cache
def _binder(fn: JITFunction, arch: int) -> tuple[Any, Any]:
    backend = make_backend(GPUTarget("cuda", arch, 32))
    return backend, create_function_from_signature(fn.signature, fn.params, backend)


Spec = dict[Any, Any]  # Triton's signature / constexprs / attrs, keyed as it keys them


def specialize(fn: JITFunction, launch: Launch, arch: int) -> tuple[Spec, Spec, Spec, Any]:
    """(signature, constexprs, attrs, options) as ``JITFunction.run`` builds them before it
    compiles (triton 3.8: ``runtime/jit.py`` run -> binder -> _pack_args)."""
    backend, binder = _binder(fn, arch)
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    return signature, constexprs, attrs, options
