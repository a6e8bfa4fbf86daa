"""Save a request's KV rows out of SGLang's MHA pool into one slab, and restore them.

Pool layout (SGLang 0.5.23 ``MHATokenToKVPool``, NHD): per layer one K and one V tensor, each
``[pool_size, num_kv_heads, head_dim]`` with contiguous rows; fp8 pools store uint8. A snapshot
is ONE contiguous tensor ``[2, num_layers, num_tokens, num_kv_heads, head_dim]`` (K then V), so
it can be pinned, kept keyed by rid and written back into whatever slots the allocator hands out
on resume. Kernels: ``kernels/kv_copy_triton.py``. MLA, HND and scaled (FP4/MXFP8) pools are
refused by ``mha_kv_buffers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kernels.kv_copy_triton import as_raw, interpreting, launch_restore, launch_save

__all__ = [
    "Backend",
    "mha_kv_buffers",
    "page_slot_ids",
    "restore_kv",
    "restore_kv_ref",
    "save_kv",
    "save_kv_ref",
]

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")


def save_kv(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slot_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
    block_tokens: int | None = None,
) -> torch.Tensor:
    """Copy the pool rows ``slot_ids`` of every layer into a snapshot. Pool is not mutated.

    k_buffers, v_buffers: L tensors [pool_size, H, D]; slot_ids: [T] int64 on the pool's
    device. Returns ``out`` (allocated if None): [2, L, T, H, D], pool dtype; on CUDA a new
    ``out`` is pinned host memory that the kernel writes directly (zero-copy).
    NOTE: on CUDA the copy is asynchronous; synchronize the stream before reading ``out`` on
    the host, and make sure the forward pass that wrote the KV is ordered before this call.
    ``backend``: "auto" = Triton on CUDA, torch on CPU (the interpreter is far too slow to
    serve with); "triton" forces the kernel (on CPU only under TRITON_INTERPRET=1).
    ``block_tokens``: Triton rows per program (None = default; results never depend on it).
    """
    buffers, row_shape = _check_pool(k_buffers, v_buffers)
    _check_slots(slot_ids, buffers[0], unique=False)
    shape = (2, len(k_buffers), slot_ids.numel(), *row_shape)
    if out is None:
        if buffers[0].is_cuda:
            out = torch.empty(shape, dtype=buffers[0].dtype, pin_memory=True)
        else:
            out = torch.empty(shape, dtype=buffers[0].dtype, device=buffers[0].device)
    _check_slab("out", out, shape, buffers[0])

    if _use_triton(backend, buffers[0]):
        launch_save(buffers, slot_ids, out, block_tokens)
        return out
    # Torch path: one index_select per buffer. On CUDA with a host slab it gathers on the
    # device and then copies, because index_select cannot write across devices.
    flat = as_raw(out).view(len(buffers), slot_ids.numel(), *row_shape)
    for dst, src in zip(flat, buffers, strict=True):
        if dst.device == src.device:
            torch.index_select(as_raw(src), 0, slot_ids, out=dst)
        else:
            dst.copy_(as_raw(src).index_select(0, slot_ids), non_blocking=True)
    return out


def restore_kv(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slot_ids: torch.Tensor,
    snapshot: torch.Tensor,
    *,
    backend: Backend = "auto",
    block_tokens: int | None = None,
) -> None:
    """Write ``snapshot`` into the pool rows ``slot_ids`` of every layer. Mutates the pool only.

    k_buffers, v_buffers: L tensors [pool_size, H, D]; slot_ids: [T] int64, unique, on the
    pool's device (normally freshly allocated, not the slots the snapshot came from);
    snapshot: [2, L, T, H, D] as returned by ``save_kv`` (pool device or, on CUDA, pinned host).
    NOTE: on CUDA the copy is asynchronous like ``save_kv``; keep ``snapshot`` alive until the
    stream has passed it.
    """
    buffers, row_shape = _check_pool(k_buffers, v_buffers)
    # Unique: two snapshot rows racing for one pool slot would leave either value behind.
    _check_slots(slot_ids, buffers[0], unique=True)
    shape = (2, len(k_buffers), slot_ids.numel(), *row_shape)
    _check_slab("snapshot", snapshot, shape, buffers[0])

    if _use_triton(backend, buffers[0]):
        launch_restore(buffers, slot_ids, snapshot, block_tokens)
        return
    flat = as_raw(snapshot).view(len(buffers), slot_ids.numel(), *row_shape)
    for dst, src in zip(buffers, flat, strict=True):
        as_raw(dst).index_copy_(0, slot_ids, src.to(dst.device, non_blocking=True))


def save_kv_ref(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], slot_ids: torch.Tensor
) -> torch.Tensor:
    """Reference ``save_kv``: per-layer advanced indexing, stacked. Returns [2, L, T, H, D]."""
    keys = torch.stack([_fp8_as_uint8(k)[slot_ids] for k in k_buffers])
    values = torch.stack([_fp8_as_uint8(v)[slot_ids] for v in v_buffers])
    return torch.stack([keys, values]).view(k_buffers[0].dtype)


def restore_kv_ref(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slot_ids: torch.Tensor,
    snapshot: torch.Tensor,
) -> None:
    """Reference ``restore_kv``: per-layer index assignment. Mutates the pool buffers."""
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        _fp8_as_uint8(k)[slot_ids] = _fp8_as_uint8(snapshot[0, layer])
        _fp8_as_uint8(v)[slot_ids] = _fp8_as_uint8(snapshot[1, layer])


def _fp8_as_uint8(t: torch.Tensor) -> torch.Tensor:
    # NOTE: index_put is missing for float8 on some devices (why SGLang stores fp8 as uint8).
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def page_slot_ids(page_ids: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    """Token slots of ``num_tokens`` tokens held in whole pages, as a paged allocator hands out.

    page_ids: [P] int64, P == ceil(num_tokens / page_size); page p covers slots
    [p * page_size, (p + 1) * page_size). Only the last page may be partial. Returns [num_tokens].
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if page_ids.dim() != 1 or page_ids.dtype != torch.int64:
        raise ValueError(
            f"page_ids must be 1-D int64, got {page_ids.dtype} {tuple(page_ids.shape)}"
        )
    num_pages = -(-num_tokens // page_size)
    if page_ids.numel() != num_pages:
        raise ValueError(
            f"{num_tokens} tokens at page_size {page_size} need {num_pages} pages, "
            f"got {page_ids.numel()}"
        )
    offsets = torch.arange(page_size, dtype=torch.int64, device=page_ids.device)
    return (page_ids[:, None] * page_size + offsets).reshape(-1)[:num_tokens]


def mha_kv_buffers(pool: object) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(k_buffers, v_buffers) of an SGLang MHA pool; refuses layouts these kernels don't cover.

    MLA pools (``MLATokenToKVPool``: one ``kv_buffer`` per layer holding the compressed latent
    plus rope part, no separate V) need a different slab shape and are not supported in v1.
    """
    if hasattr(pool, "kv_buffer") and not hasattr(pool, "k_buffer"):
        raise NotImplementedError(
            f"{type(pool).__name__} is an MLA-style pool (one kv_buffer per layer); KV snapshots "
            "support MHA pools with separate k_buffer/v_buffer only"
        )
    k_buffers = getattr(pool, "k_buffer", None)
    v_buffers = getattr(pool, "v_buffer", None)
    if not k_buffers or not v_buffers:
        raise NotImplementedError(f"{type(pool).__name__} has no per-layer k_buffer/v_buffer")
    if getattr(pool, "use_hnd", False) or getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        raise NotImplementedError(f"{type(pool).__name__}: only the NHD layout is supported")
    if getattr(pool, "k_scale_buffer", None) is not None:
        raise NotImplementedError(f"{type(pool).__name__}: scaled (FP4/MXFP8) KV is unsupported")
    return list(k_buffers), list(v_buffers)


def _use_triton(backend: str, ref: torch.Tensor) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return ref.is_cuda
    if backend == "triton" and not ref.is_cuda and not interpreting():
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
    return backend == "triton"


def _check_pool(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], tuple[int, int]]:
    """All 2L buffers (K then V) and their common row shape (H, D), or ValueError."""
    if len(k_buffers) == 0 or len(k_buffers) != len(v_buffers):
        raise ValueError(
            f"need the same nonzero number of K and V layers, got {len(k_buffers)} and "
            f"{len(v_buffers)}"
        )
    buffers = [*k_buffers, *v_buffers]
    first = buffers[0]
    if first.dim() != 3:
        raise ValueError(f"pool buffers must be [pool_size, H, D], got {tuple(first.shape)}")
    for i, buf in enumerate(buffers):
        name = f"{'kv'[i // len(k_buffers)]}_buffers[{i % len(k_buffers)}]"
        if buf.dtype != first.dtype:
            raise ValueError(f"{name} dtype {buf.dtype} != {first.dtype} (k_buffers[0])")
        if buf.shape != first.shape:
            raise ValueError(
                f"{name} shape {tuple(buf.shape)} != {tuple(first.shape)} (k_buffers[0]); "
                "K and V rows must match (v_head_dim == head_dim)"
            )
        if buf.device != first.device:
            raise ValueError(f"{name} on {buf.device}, k_buffers[0] on {first.device}")
        # Contiguous rows: the kernels address row s at base + s * H * D.
        if not buf.is_contiguous():
            raise ValueError(f"{name} must be contiguous, strides {buf.stride()}")
    return buffers, (first.shape[1], first.shape[2])


def _check_slots(slot_ids: torch.Tensor, pool: torch.Tensor, *, unique: bool) -> None:
    if not isinstance(slot_ids, torch.Tensor) or slot_ids.dtype != torch.int64:
        got = slot_ids.dtype if isinstance(slot_ids, torch.Tensor) else type(slot_ids)
        raise ValueError(f"slot_ids must be an int64 tensor, got {got}")
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids must be 1-D, got shape {tuple(slot_ids.shape)}")
    if slot_ids.device != pool.device:
        raise ValueError(f"slot_ids on {slot_ids.device}, pool on {pool.device}")
    if not slot_ids.is_contiguous():
        raise ValueError("slot_ids must be contiguous")
    if slot_ids.numel() == 0:
        return
    # NOTE: one device sync on CUDA; an out-of-range slot would read or corrupt other memory.
    low, high = (int(x) for x in torch.aminmax(slot_ids))
    if low < 0 or high >= pool.shape[0]:
        raise ValueError(f"slot_ids span [{low}, {high}], pool has {pool.shape[0]} slots")
    if unique and torch.unique(slot_ids).numel() != slot_ids.numel():
        raise ValueError("slot_ids must be unique when restoring")


def _check_slab(name: str, slab: torch.Tensor, shape: tuple[int, ...], pool: torch.Tensor) -> None:
    if tuple(slab.shape) != shape:
        raise ValueError(f"{name} shape {tuple(slab.shape)} != expected {shape} [2, L, T, H, D]")
    if slab.dtype != pool.dtype:
        raise ValueError(f"{name} dtype {slab.dtype} != pool dtype {pool.dtype}")
    if not slab.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    host_of_cuda = pool.is_cuda and slab.device.type == "cpu"
    if slab.device != pool.device and not host_of_cuda:
        raise ValueError(f"{name} on {slab.device}, pool on {pool.device}")
    if host_of_cuda and not slab.is_pinned():
        raise ValueError(f"{name} is host memory of a CUDA pool and must be pinned")
