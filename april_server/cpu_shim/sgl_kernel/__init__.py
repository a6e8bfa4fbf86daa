"""CPU stand-in for the two `sgl_kernel` ops SGLang 0.5.23 imports on its CPU engine.

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


def __getattr__(name: str) -> Callable[..., NoReturn]:
    """SGLang's CPU engine imports more ops at start-up than it calls (speculative decoding,
    MoE...): importing any name succeeds, calling one we lack raises naming it."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in april-server's CPU shim "
            "(only assign_req_to_token_pool_cpu and copy_all_layer_kv_cache_cpu are); "
            "install the real sglang-kernel on a GPU machine"
        )

    missing.__name__ = name
    missing.__qualname__ = name
    return missing
