"""CPU stand-in for the two `sgl_kernel` ops SGLang 0.5.23 imports on its CPU engine, plus
the torch op `torch.ops.sgl_kernel.murmur_hash32_cpu` that its seeded sampling calls on CPU.

Any other op can be imported but raises NotImplementedError naming it when called, so a
missing op is a clear error at the call site rather than a silent wrong result. See ../README.md.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NoReturn

import torch

__version__ = "0.0.0+april-cpu-shim"
APRIL_CPU_SHIM = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc
    (runs laid end to end), like SGLang's Triton `assign_req_to_token_pool`."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends, strict=True):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer b (a uint64 base pointer with a row stride in bytes), copy row
    src_loc[j] to row tgt_loc[j] (SGLang's `copy_all_layer_kv_cache_tiled` on CPU)."""
    bases = data_ptrs.tolist()
    row_bytes = strides.tolist()
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(bases, row_bytes, strict=True):
        for tgt, src in pairs:
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


# ---- murmur_hash32_cpu: the noise source of seeded sampling ----------------------------------
# `--enable-deterministic-inference` samples with Gumbel noise derived from a hash of (seed,
# position, token id): `sglang.kernels.ops.sampling.murmur_hash.murmur_hash32` calls
# `torch.ops.sgl_kernel.murmur_hash32_cpu.default(seed, positions, col_indices)` for CPU tensors
# (its Triton kernel on GPU). Same hash, bit for bit: MurmurHash3 x86_32 over four 32-bit blocks
# (seed low, seed high, position, token id), h starting at 0, length 16, fmix32. Computed in
# int64 on values below 2**32; a product with a 32-bit constant is split at 16 bits so nothing
# ever exceeds 2**49 (no signed overflow), then reduced mod 2**32.

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) and a 32-bit constant c."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _low32(t: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of each element of a 64-bit integer tensor, as non-negative int64."""
    if t.dtype == torch.uint64:
        t = t.view(torch.int64)  # same bits; uint64 tensors support few ops
    return t.to(torch.int64) & _M32


def murmur_hash32_reference(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    """[n, m] uint32: hash(seed[i], positions[i], col_indices[j]); see the comment above."""
    if seed.dim() != 1 or positions.dim() != 1 or col_indices.dim() != 1:
        raise ValueError("seed, positions and col_indices must be 1-D")
    if seed.shape[0] != positions.shape[0]:
        raise ValueError("seed and positions must have the same length")
    if seed.dtype != torch.uint64:
        raise TypeError(f"seed must have dtype torch.uint64, not {seed.dtype}")
    if positions.dtype not in (torch.int64, torch.uint64):
        raise TypeError(
            f"positions must have dtype torch.int64 or torch.uint64, not {positions.dtype}"
        )
    if col_indices.dtype != torch.int64:
        raise TypeError(f"col_indices must have dtype torch.int64, not {col_indices.dtype}")
    s = seed.contiguous().view(torch.int64)
    zero = torch.zeros_like(s)
    h = _murmur3_mix(zero, s & _M32)
    h = _murmur3_mix(h, (s >> 32) & _M32)  # arithmetic shift: the mask drops the sign fill
    h = _murmur3_mix(h, _low32(positions.contiguous()))
    h = _murmur3_mix(h.unsqueeze(1), _low32(col_indices).unsqueeze(0))
    h = _fmix32(h ^ 16)
    # int64 -> int32 keeps the low 32 bits (two's complement); the view makes them uint32.
    return h.to(torch.int32).view(torch.uint32)


def _register_murmur_op() -> None:
    """Define `torch.ops.sgl_kernel.murmur_hash32_cpu` (with a fake kernel for torch.compile:
    SGLang calls it inside the compiled `multinomial_with_seed`)."""
    if hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return

    @torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=(), device_types="cpu")
    def murmur_hash32_cpu(
        seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
    ) -> torch.Tensor:
        return murmur_hash32_reference(seed, positions, col_indices)

    @murmur_hash32_cpu.register_fake
    def _(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
        return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)


_register_murmur_op()


def __getattr__(name: str) -> Callable[..., NoReturn]:
    """SGLang's CPU engine imports more ops at start-up than it calls (speculative decoding,
    MoE...): importing any name succeeds, calling one we lack raises naming it."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in april-server's CPU shim "
            "(only assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu and the torch op "
            "murmur_hash32_cpu are); "
            "install the real sglang-kernel on a GPU machine"
        )

    missing.__name__ = name
    missing.__qualname__ = name
    return missing
