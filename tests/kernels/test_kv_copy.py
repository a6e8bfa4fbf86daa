"""kernels/kv_copy.py: Triton and torch paths against the references.

Pools live on CUDA when there is a device (real kernels, pinned host slabs), else on CPU with
Triton in its interpreter. A copy does no arithmetic, so every comparison is on raw bytes
(rtol=0, atol=0): pools are filled with random bytes, NaN payloads and all.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels.kv_copy import (
    mha_kv_buffers,
    page_slot_ids,
    restore_kv,
    restore_kv_ref,
    save_kv,
    save_kv_ref,
)
from kernels.kv_copy_triton import launch_save

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_TOKENS = (0, 1, 7, 33)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8) + (
    (torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ()
)
PAGE_SIZES = (1, 16)
NUM_LAYERS = (1, 3)
HEAD_SHAPES = ((1, 12), (3, 5))  # (num_kv_heads, head_dim): rows of 12 and 15 elements

GRID = list(itertools.product(NUM_TOKENS, DTYPES, PAGE_SIZES, NUM_LAYERS, HEAD_SHAPES))
GRID_IDS = [f"t{t}-{str(d)[6:]}-p{p}-l{n}-h{h}x{dim}" for t, d, p, n, (h, dim) in GRID]


def covering(grid: list[tuple]) -> set[tuple]:
    """A subset where every (token count, dtype) pair occurs, and every combination of page
    size, layer count and head shape: each dtype, layout and edge size at least once."""
    chosen = set()
    for i, (t, d) in enumerate(itertools.product(NUM_TOKENS, DTYPES)):
        p, n, h = PAGE_SIZES[i % 2], NUM_LAYERS[i // 2 % 2], HEAD_SHAPES[i // 4 % 2]
        chosen.add((t, d, p, n, h))
    return chosen


COVER = covering(GRID)


def grid_params() -> list:
    """The torch backend on the whole grid; Triton too on a GPU. In the Triton interpreter
    (CPU, ~50x slower) the covering subset runs in `make test`, the rest in `make test-slow`."""
    out = []
    for backend in ("triton", "torch"):
        for case, case_id in zip(GRID, GRID_IDS, strict=True):
            slow = backend == "triton" and DEVICE == "cpu" and case not in COVER
            marks = [pytest.mark.slow] if slow else []
            out.append(pytest.param(backend, *case, id=f"{backend}-{case_id}", marks=marks))
    return out


def _make_pool(num_layers, num_pages, page_size, heads, head_dim, dtype):
    """(k_buffers, v_buffers): L tensors [num_pages * page_size, H, D] of random bytes."""
    size = num_pages * page_size
    width = head_dim * torch.empty(0, dtype=dtype).element_size()

    def buf():
        raw = torch.randint(0, 256, (size, heads, width), dtype=torch.uint8, device=DEVICE)
        return raw.view(dtype)

    return [buf() for _ in range(num_layers)], [buf() for _ in range(num_layers)]


def _two_slot_sets(num_tokens, num_pages, page_size):
    """Disjoint slot ids for a save and a later restore, whole pages as an allocator gives.

    Page 0 is skipped: SGLang reserves it as padding for dummy writes.
    """
    need = -(-num_tokens // page_size)
    pages = torch.randperm(num_pages - 1)[: 2 * need] + 1
    return (
        page_slot_ids(pages[:need], page_size, num_tokens).to(DEVICE),
        page_slot_ids(pages[need:], page_size, num_tokens).to(DEVICE),
    )


def _setup(num_tokens, dtype, page_size, num_layers, head_shape):
    num_pages = 2 * -(-max(num_tokens, 1) // page_size) + 3
    k, v = _make_pool(num_layers, num_pages, page_size, *head_shape, dtype)
    src, dst = _two_slot_sets(num_tokens, num_pages, page_size)
    return k, v, src, dst


def _raw(t: torch.Tensor) -> torch.Tensor:
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # kernels write pinned host slabs asynchronously
    return t.cpu().contiguous().view(torch.uint8)


def _clone(buffers):
    return [b.clone() for b in buffers]


def _assert_same_bytes(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(_raw(actual), _raw(expected))


def _assert_pools_equal(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        _assert_same_bytes(a, e)


@pytest.mark.parametrize("backend,num_tokens,dtype,page_size,num_layers,head_shape", grid_params())
def test_save_matches_ref(backend, num_tokens, dtype, page_size, num_layers, head_shape):
    k, v, src, _ = _setup(num_tokens, dtype, page_size, num_layers, head_shape)
    k0, v0 = _clone(k), _clone(v)

    snap = save_kv(k, v, src, backend=backend)

    heads, head_dim = head_shape
    assert snap.shape == (2, num_layers, num_tokens, heads, head_dim)
    _assert_same_bytes(snap, save_kv_ref(k, v, src))
    _assert_pools_equal(k + v, k0 + v0)  # saving never writes the pool


@pytest.mark.parametrize("backend,num_tokens,dtype,page_size,num_layers,head_shape", grid_params())
def test_round_trip_into_new_slots(backend, num_tokens, dtype, page_size, num_layers, head_shape):
    k, v, src, dst = _setup(num_tokens, dtype, page_size, num_layers, head_shape)
    original = _clone(k + v)
    expected_k, expected_v = _clone(k), _clone(v)
    restore_kv_ref(expected_k, expected_v, dst, save_kv_ref(k, v, src))

    snap = save_kv(k, v, src, backend=backend)
    restore_kv(k, v, dst, snap, backend=backend)

    # Whole-pool equality with the reference also proves no other slot was touched; the
    # explicit checks below say the same thing without trusting restore_kv_ref.
    _assert_pools_equal(k + v, expected_k + expected_v)
    untouched = torch.ones(k[0].shape[0], dtype=torch.bool, device=DEVICE)
    untouched[dst] = False
    for now, before in zip(k + v, original, strict=True):
        _assert_same_bytes(now[dst], before[src])
        _assert_same_bytes(now[untouched], before[untouched])


def test_the_covering_subset_covers() -> None:
    for values, at in ((NUM_TOKENS, 0), (DTYPES, 1), (PAGE_SIZES, 2), (NUM_LAYERS, 3)):
        assert {c[at] for c in COVER} == set(values)
    assert {c[4] for c in COVER} == set(HEAD_SHAPES)
    assert {(c[0], c[1]) for c in COVER} == set(itertools.product(NUM_TOKENS, DTYPES))
    assert len({(c[2], c[3], c[4]) for c in COVER}) == 8
    assert len(COVER) < len(GRID) // 4


@pytest.mark.parametrize("block_tokens,block_cols", [(1, 4), (2, 16), (4, 8), (64, 16), (None, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_launch_geometry_does_not_change_bytes(block_tokens, block_cols, dtype):
    # Rows of 15 elements: every block_cols here leaves a masked tail in the column loop.
    k, v, src, _ = _setup(33, dtype, 16, 3, (3, 5))
    out = torch.zeros(2, 3, 33, 3, 5, dtype=dtype, device=DEVICE)
    launch_save(k + v, src, out, block_tokens=block_tokens, block_cols=block_cols)
    _assert_same_bytes(out, save_kv_ref(k, v, src))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_save_into_given_out_overwrites_all_of_it(backend):
    k, v, src, _ = _setup(7, torch.float16, 1, 3, (1, 12))
    out = torch.full((2, 3, 7, 1, 12), float("nan"), dtype=torch.float16, device=DEVICE)
    assert save_kv(k, v, src, out, backend=backend) is out
    _assert_same_bytes(out, save_kv_ref(k, v, src))


def test_auto_backend_on_cpu_takes_torch_path(monkeypatch):
    # The interpreter is far too slow to serve with; "auto" must never route CPU to it.
    def fail(*args, **kwargs):
        raise AssertionError("Triton launched for CPU tensors under backend='auto'")

    monkeypatch.setattr("kernels.kv_copy.launch_save", fail)
    monkeypatch.setattr("kernels.kv_copy.launch_restore", fail)
    k, v, src, dst = _setup(7, torch.bfloat16, 1, 3, (1, 12))
    k, v, src, dst = [b.cpu() for b in k], [b.cpu() for b in v], src.cpu(), dst.cpu()
    snap = save_kv(k, v, src)
    restore_kv(k, v, dst, snap)
    _assert_same_bytes(snap, save_kv_ref(k, v, dst))


@pytest.mark.gpu
def test_cuda_slab_defaults_to_pinned_host_and_must_be_pinned():
    k, v, src, dst = _setup(33, torch.bfloat16, 16, 3, (8, 128))
    snap = save_kv(k, v, src)
    assert snap.device.type == "cpu" and snap.is_pinned()
    _assert_same_bytes(snap, save_kv_ref(k, v, src))
    restore_kv(k, v, dst, snap)
    _assert_same_bytes(save_kv_ref(k, v, dst), snap)
    pageable = torch.empty(snap.shape, dtype=snap.dtype)
    with pytest.raises(ValueError, match="pinned"):
        save_kv(k, v, src, pageable)
    with pytest.raises(ValueError, match="pinned"):
        restore_kv(k, v, dst, pageable)


def test_page_slot_ids_whole_pages_last_partial():
    slots = page_slot_ids(torch.tensor([5, 2, 9]), 16, 35)
    expected = list(range(80, 96)) + list(range(32, 48)) + [144, 145, 146]
    assert slots.tolist() == expected
    assert page_slot_ids(torch.tensor([4, 1]), 1, 2).tolist() == [4, 1]
    assert page_slot_ids(torch.empty(0, dtype=torch.int64), 16, 0).numel() == 0


@pytest.mark.parametrize(
    "pages,page_size,num_tokens",
    [([1, 2], 16, 16), ([1], 16, 17), ([1], 0, 1), ([1.0], 16, 1)],
    ids=["too-many-pages", "too-few-pages", "zero-page-size", "float-pages"],
)
def test_page_slot_ids_rejects(pages, page_size, num_tokens):
    with pytest.raises(ValueError):
        page_slot_ids(torch.tensor(pages), page_size, num_tokens)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values as ``t`` but every other element of a wider tensor."""
    return torch.cat([t, t], dim=-1)[..., ::2]


def _bad_cases():
    """(name, kwargs-builder) pairs; each builder returns (k, v, slots, slab) with one defect."""

    def base():
        k, v, src, dst = _setup(7, torch.bfloat16, 1, 3, (1, 12))
        return k, v, dst, save_kv_ref(k, v, src)

    def edit(fn):
        def build():
            k, v, slots, slab = base()
            return fn(k, v, slots, slab)

        return build

    size = base()[0][0].shape[0]
    return {
        "int32-slots": edit(lambda k, v, s, x: (k, v, s.int(), x)),
        "float-slots": edit(lambda k, v, s, x: (k, v, s.float(), x)),
        "2d-slots": edit(lambda k, v, s, x: (k, v, s[None], x)),
        "list-slots": edit(lambda k, v, s, x: (k, v, s.tolist(), x)),
        "slot-too-big": edit(lambda k, v, s, x: (k, v, torch.cat([s[:-1], s.new([size])]), x)),
        "slot-negative": edit(lambda k, v, s, x: (k, v, torch.cat([s[:-1], s.new([-1])]), x)),
        "layers-mismatch": edit(lambda k, v, s, x: (k, v[:2], s, x)),
        "no-layers": edit(lambda k, v, s, x: ([], [], s, x)),
        "dtype-mismatch": edit(lambda k, v, s, x: (k[:2] + [k[2].half()], v, s, x)),
        "v-head-dim": edit(lambda k, v, s, x: (k, [b[..., :8].contiguous() for b in v], s, x)),
        "not-contiguous": edit(lambda k, v, s, x: (k[:2] + [_strided(k[2])], v, s, x)),
        "2d-buffers": edit(lambda k, v, s, x: ([b[:, 0] for b in k], [b[:, 0] for b in v], s, x)),
        "slab-tokens": edit(lambda k, v, s, x: (k, v, s, x[:, :, :-1])),
        "slab-layers": edit(lambda k, v, s, x: (k, v, s, x[:, :2])),
        "slab-dtype": edit(lambda k, v, s, x: (k, v, s, x.half())),
        "slab-strided": edit(lambda k, v, s, x: (k, v, s, _strided(x))),
    }


BAD_CASES = _bad_cases()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_raises_before_touching_anything(case, backend):
    k, v, slots, slab = BAD_CASES[case]()
    before = _clone(k + v)
    slab_before = slab.clone()
    with pytest.raises(ValueError):
        restore_kv(k, v, slots, slab, backend=backend)
    _assert_pools_equal(k + v, before)
    if case.startswith("slab"):
        with pytest.raises(ValueError):
            save_kv(k, v, slots, slab, backend=backend)
        _assert_same_bytes(slab, slab_before)
    else:
        with pytest.raises(ValueError):
            save_kv(k, v, slots, backend=backend)


def test_restore_rejects_duplicate_slots():
    k, v, src, dst = _setup(7, torch.float32, 1, 1, (1, 12))
    before = _clone(k + v)
    dup = dst.clone()
    dup[-1] = dup[0]
    with pytest.raises(ValueError, match="unique"):
        restore_kv(k, v, dup, save_kv_ref(k, v, src), backend="triton")
    _assert_pools_equal(k + v, before)
    save_kv(k, v, dup)  # duplicates are fine to read


def test_unknown_backend_rejected():
    k, v, src, _ = _setup(1, torch.float32, 1, 1, (1, 12))
    with pytest.raises(ValueError, match="backend"):
        save_kv(k, v, src, backend="cuda")


def test_mha_kv_buffers_refuses_mla_and_other_layouts():
    latent = [torch.zeros(16, 1, 576)]  # MLATokenToKVPool: [size + page, 1, kv_cache_dim]
    with pytest.raises(NotImplementedError, match="MLA"):
        mha_kv_buffers(SimpleNamespace(kv_buffer=latent))
    k, v = [torch.zeros(16, 2, 8)], [torch.zeros(16, 2, 8)]
    with pytest.raises(NotImplementedError, match="NHD"):
        mha_kv_buffers(SimpleNamespace(k_buffer=k, v_buffer=v, use_hnd=True))
    with pytest.raises(NotImplementedError, match="scaled"):
        mha_kv_buffers(SimpleNamespace(k_buffer=k, v_buffer=v, k_scale_buffer=[k[0]]))
    got_k, got_v = mha_kv_buffers(SimpleNamespace(k_buffer=k, v_buffer=v, kv_cache_layout="nhd"))
    assert got_k[0] is k[0] and got_v[0] is v[0]


def test_against_sglang_mha_pool():
    # Runs in a subprocess: importing sglang takes ~10 s, warns (the suite turns warnings into
    # errors), and maybe_stub_sgl_kernel() installs a process-wide import hook.
    script = Path(__file__).with_name("sglang_pool_check.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sglang pool check OK" in proc.stdout
