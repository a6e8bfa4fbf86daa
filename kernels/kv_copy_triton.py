"""Triton gather/scatter of KV rows between SGLang's MHA pool and one snapshot slab.

Every layer, K and V, moves in ONE launch: the kernels read per-buffer base addresses from an
int64 table ``[k_0 .. k_{L-1}, v_0 .. v_{L-1}]`` (the order of the snapshot's ``[2, L]`` axes),
so program axis 1 indexes the table and the slab alike. Rows are copied as raw same-width
integers, so bf16, fp16, fp32 and fp8 (uint8 in SGLang's pool) round-trip bit-exactly.

Validation lives in ``kernels/kv_copy.py``; the launchers here trust their arguments.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Raw-copy element type per itemsize: a copy does no arithmetic, so integers of the same
# width carry any float format (incl. float8, which some torch ops reject) bit for bit.
_INT_OF_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Tile sizes. NOTE: untuned on GPU (no device was available when this was written); the
# interpreter costs ~1.8 ms per program instance (sglang-integration.md §7), so it wants few,
# large tiles: 64 rows per program.
_GPU_TILE_BYTES = 16 * 1024
_GPU_MAX_COL_BYTES = 4 * 1024
# Unaligned launches move one element per access, each with its own 64-bit address and mask
# bit; 16 KiB of 1- or 2-byte elements (64-128 per thread at 4 warps) makes ptxas spill, and
# so do 32 bytes per thread, so their tiles hold 2048 elements (16 per thread). Every row also
# costs its threads a slot id: at most 1024 rows per tile (8 per thread).
# tests/kernels/test_aot.py compiles every tile and fails on a spill.
_GPU_UNALIGNED_TILE_ELEMS = 2048
_GPU_MAX_BLOCK_TOKENS = 1024
_INTERPRET_BLOCK_TOKENS = 64


@triton.jit
def _kv_save_kernel(
    ptr_table,  # int64 [2 * num_layers]: data_ptr() of k_0..k_{L-1}, v_0..v_{L-1}
    slot_ids_ptr,  # int64 [num_tokens]: pool rows to read, all in [0, pool_size)
    out_ptr,  # int [2 * num_layers, num_tokens, row_elems]: contiguous snapshot slab
    num_tokens,  # rows per buffer in the slab
    row_elems,  # num_kv_heads * head_dim; also the pool's row stride (contiguous NHD)
    BLOCK_TOKENS: tl.constexpr,  # slab rows per program
    BLOCK_COLS: tl.constexpr,  # row elements per inner step (power of two)
    ALIGNED: tl.constexpr,  # 16-byte aligned bases, rows of 16k elements: 128-bit access
):
    # int64 program ids: slot * row_elems and buf * num_tokens * row_elems overflow int32
    # for real pools (e.g. 1M slots x 1024 elements).
    tok_block = tl.program_id(0).to(tl.int64)
    buf = tl.program_id(1).to(tl.int64)
    src = tl.load(ptr_table + buf).to(tl.pointer_type(out_ptr.dtype.element_ty))
    if ALIGNED:
        src = tl.multiple_of(src, 16)

    toks = tok_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS).to(tl.int64)
    tok_mask = toks < num_tokens
    slots = tl.load(slot_ids_ptr + toks, mask=tok_mask, other=0)
    src_rows = src + slots[:, None] * row_elems
    dst_rows = out_ptr + (buf * num_tokens + toks)[:, None] * row_elems
    for col0 in range(0, row_elems, BLOCK_COLS):
        cols = col0 + tl.arange(0, BLOCK_COLS)
        mask = tok_mask[:, None] & (cols < row_elems)[None, :]
        vals = tl.load(src_rows + cols[None, :], mask=mask)
        tl.store(dst_rows + cols[None, :], vals, mask=mask)


@triton.jit
def _kv_restore_kernel(
    ptr_table,  # int64 [2 * num_layers]: data_ptr() of k_0..k_{L-1}, v_0..v_{L-1}
    slot_ids_ptr,  # int64 [num_tokens]: pool rows to write, unique, all in [0, pool_size)
    snap_ptr,  # int [2 * num_layers, num_tokens, row_elems]: contiguous snapshot slab
    num_tokens,  # rows per buffer in the slab
    row_elems,  # num_kv_heads * head_dim; also the pool's row stride (contiguous NHD)
    BLOCK_TOKENS: tl.constexpr,  # slab rows per program
    BLOCK_COLS: tl.constexpr,  # row elements per inner step (power of two)
    ALIGNED: tl.constexpr,  # 16-byte aligned bases, rows of 16k elements: 128-bit access
):
    tok_block = tl.program_id(0).to(tl.int64)
    buf = tl.program_id(1).to(tl.int64)
    dst = tl.load(ptr_table + buf).to(tl.pointer_type(snap_ptr.dtype.element_ty))
    if ALIGNED:
        dst = tl.multiple_of(dst, 16)

    toks = tok_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS).to(tl.int64)
    tok_mask = toks < num_tokens
    slots = tl.load(slot_ids_ptr + toks, mask=tok_mask, other=0)
    src_rows = snap_ptr + (buf * num_tokens + toks)[:, None] * row_elems
    dst_rows = dst + slots[:, None] * row_elems
    for col0 in range(0, row_elems, BLOCK_COLS):
        cols = col0 + tl.arange(0, BLOCK_COLS)
        mask = tok_mask[:, None] & (cols < row_elems)[None, :]
        vals = tl.load(src_rows + cols[None, :], mask=mask)
        tl.store(dst_rows + cols[None, :], vals, mask=mask)


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (CPU-only machines)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def as_raw(t: torch.Tensor) -> torch.Tensor:
    """Same bytes, viewed as the unsigned/signed integer type of the same width."""
    return t.view(_INT_OF_ITEMSIZE[t.element_size()])


@functools.lru_cache(maxsize=16)
def _ptr_table(ptrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Cached because SGLang's pool buffers live for the whole server: building the table costs
    # a host->device copy, which would otherwise run on every snapshot. Keyed by the addresses
    # themselves, so a freed-and-reallocated pool simply gets a fresh (or identical) table.
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def _geometry(
    row_elems: int,
    itemsize: int,
    block_tokens: int | None,
    block_cols: int | None,
    aligned: bool = True,
) -> tuple[int, int]:
    """(BLOCK_TOKENS, BLOCK_COLS) for one launch; None picks the default."""
    if block_cols is None:
        max_cols = max(16, _GPU_MAX_COL_BYTES // itemsize)
        if not aligned:
            max_cols = min(max_cols, _GPU_UNALIGNED_TILE_ELEMS)
        block_cols = min(triton.next_power_of_2(row_elems), max_cols)
    if block_tokens is None:
        if interpreting():
            block_tokens = _INTERPRET_BLOCK_TOKENS
        else:
            tile_elems = _GPU_TILE_BYTES // itemsize if aligned else _GPU_UNALIGNED_TILE_ELEMS
            block_tokens = max(1, min(tile_elems // block_cols, _GPU_MAX_BLOCK_TOKENS))
    return triton.next_power_of_2(block_tokens), triton.next_power_of_2(block_cols)


def _launch(
    kernel: triton.JITFunction,
    buffers: list[torch.Tensor],
    slot_ids: torch.Tensor,
    slab: torch.Tensor,
    block_tokens: int | None,
    block_cols: int | None,
) -> None:
    # buffers: 2L pool tensors [pool_size, H, D] (K layers then V layers); slot_ids: [T] int64;
    # slab: [2, L, T, H, D] contiguous, same dtype as the buffers.
    num_tokens = slot_ids.numel()
    if num_tokens == 0:
        return
    row_elems = buffers[0][0].numel()
    ptrs = tuple(b.data_ptr() for b in buffers)
    table = _ptr_table(ptrs, buffers[0].device)
    aligned = all(p % 16 == 0 for p in ptrs) and slab.data_ptr() % 16 == 0
    # Rows must be 16 *elements*, not merely 16 bytes: the JIT marks row_elems divisible by 16
    # and nothing finer, and a hint cannot be added inside the kernel (tl.multiple_of on a
    # kernel argument is silently dropped), so e.g. 8-element bf16 rows would not vectorize.
    aligned = aligned and row_elems % 16 == 0
    block_t, block_c = _geometry(row_elems, slab.element_size(), block_tokens, block_cols, aligned)
    grid = (triton.cdiv(num_tokens, block_t), len(buffers))
    kernel[grid](
        table,
        slot_ids,
        as_raw(slab),
        num_tokens,
        row_elems,
        BLOCK_TOKENS=block_t,
        BLOCK_COLS=block_c,
        ALIGNED=aligned,
    )


def launch_save(
    buffers: list[torch.Tensor],
    slot_ids: torch.Tensor,
    out: torch.Tensor,
    block_tokens: int | None = None,
    block_cols: int | None = None,
) -> None:
    """Gather ``buffers[b][slot_ids]`` into ``out[b]`` for every buffer b. Mutates ``out``."""
    _launch(_kv_save_kernel, buffers, slot_ids, out, block_tokens, block_cols)


def launch_restore(
    buffers: list[torch.Tensor],
    slot_ids: torch.Tensor,
    snapshot: torch.Tensor,
    block_tokens: int | None = None,
    block_cols: int | None = None,
) -> None:
    """Scatter ``snapshot[b]`` into ``buffers[b][slot_ids]``. Mutates the pool buffers."""
    _launch(_kv_restore_kernel, buffers, slot_ids, snapshot, block_tokens, block_cols)
