"""Compile every launch of the KV copy kernels for real GPU targets and check the code. No GPU.

    python -m kernels.gpu_check.aot_check [--archs 80,90,100] [--kernels save,restore]
        [--itemsizes 1,2,4,8] [--kernels-module kernels.kv_copy_triton] [--sass some]
        [--json-out FILE]

For each launch of ``aot_variants.launches`` and each target (sm_80, sm_90a, sm_100a
by default) Triton compiles TTIR -> PTX -> cubin with its bundled ptxas (ptxas-blackwell for
sm_100a); the check reads:

- aligned path (16-byte aligned memory, rows of 16k elements): every global load and store of
  the column loop (the copy itself) is >= 128 bits, and its stores cover the tile exactly
  once; in the PTX of every launch, and in the SASS (cuobjdump) of the widest aligned tile per
  kernel and element width (``--sass all`` for every launch: ~0.35 s more each);
- unaligned path: no access of the copy wider than the alignment the memory really has (a
  wider one is a misaligned-address fault on a GPU);
- no register spills (ptxas -v), on every launch;
- 64-bit address math: no multiply, shift or truncation narrower than 64 bits in the TTIR.

Exit 0 when every check holds, 1 when any fails (each failure printed). TRITON_INTERPRET must
be unset (the kernels must be JITFunctions); the tests run this in a subprocess for that.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from types import ModuleType
from typing import Any

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.gpu_check.aot_inspect import (
    Access,
    histogram,
    loop_accesses,
    ptx_accesses,
    ptx_target,
    ptxas_report,
    sass_accesses,
    ttir_narrow_int_ops,
)
from kernels.gpu_check.aot_variants import (
    ITEMSIZES,
    KERNELS,
    Launch,
    Spec,
    huge_pool_launch,
    launches,
    tiles,
)
from kernels.gpu_check.aot_variants import specialize as jit_specialize

ARCHS = (80, 90, 100)


def specialization_summary(signature: Spec, constexprs: Spec, attrs: Spec) -> dict[str, Any]:
    """JSON-able: the types, the constants and which arguments the JIT marks divisible by 16."""
    names = list(signature)
    return {
        "signature": signature,
        "constexprs": {names[k[0]]: v for k, v in constexprs.items()},
        "divisible_16": sorted(
            names[k[0]] for k, a in attrs.items() if ["tt.divisibility", 16] in a
        ),
    }


def compile_kernel(
    fn: Any, arch: int, signature: Spec, constexprs: Spec, attrs: Spec, options: Any
) -> tuple[dict[str, Any], str]:
    """Triton's compile of one specialization for ``arch``: (asm by stage, ptxas -v log)."""
    log = io.StringIO()
    # Always compile (no cache hit) with the ptxas log printed: the spill figures must come
    # from the ptxas run that produced the very cubin checked here.
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
    return kernel.asm, log.getvalue()


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cuobjdump = knobs.nvidia.cuobjdump.path
        return subprocess.run(
            [cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout


def width_problems(launch: Launch, where: str, accesses: list[Access], threads: int) -> list[str]:
    """What is wrong with the global access widths of one compiled launch (empty: nothing).

    Judged on the column loop, which holds the copy itself (the pointer table entry and the
    slot ids are 64-bit loads before it); a kernel without a loop (a JIT-constant one-element
    row) is judged whole."""
    loop = loop_accesses(accesses)
    copy = accesses if loop is None else loop
    seen = f"all: {histogram(accesses)}" if loop is None else f"column loop: {histogram(loop)}"
    stores = [a for a in copy if a.op == "st"]
    loads = [a for a in copy if a.op == "ld"]
    if not stores:
        return [f"{where}: no global store in the copy ({seen})"]
    out = []
    if launch.expect_vectors:
        narrow_loads = sum(a.bits < 128 for a in loads)
        narrow_stores = sum(a.bits < 128 for a in stores)
        if loop is None or narrow_loads or narrow_stores or not loads:
            out.append(
                f"{where}: aligned path, but {narrow_loads} of {len(loads)} loads and "
                f"{narrow_stores} of {len(stores)} stores are narrower than 128 bits ({seen})"
            )
        tile_bytes = launch.block_tokens * launch.block_cols * launch.itemsize
        stored = sum(a.bits for a in stores) // 8
        # num_tokens == 1 is a JIT constant: the compiler then drops the tile's other rows.
        if launch.num_tokens > 1 and stored * threads != tile_bytes:
            out.append(
                f"{where}: {stored} bytes stored per thread x {threads} threads != the "
                f"{tile_bytes}-byte tile ({seen})"
            )
        return out
    # Save reads the pool and writes the slab; restore the other way round.
    load_align, store_align = (
        (launch.pool_align, launch.slab_align)
        if launch.kernel == "save"
        else (launch.slab_align, launch.pool_align)
    )
    if loop is None:  # then the 64-bit slot id and pointer table loads are in the count
        load_align = max(load_align, 8)
    for op, group, align in (("store", stores, store_align), ("load", loads, load_align)):
        too_wide = sorted({a.bits for a in group if a.bits > 8 * align})
        if too_wide:
            out.append(
                f"{where}: {op}s of {too_wide} bits where the memory is only {align}-byte "
                f"aligned (a misaligned access on a GPU) ({seen})"
            )
    return out


def check_launch(
    fn: Any, launch: Launch, arch: int, cache: dict[str, Any], disassemble: bool
) -> dict[str, Any]:
    """Compile (once per distinct specialization) and check; a JSON-able record.
    ``disassemble``: also check the SASS (cuobjdump costs ~0.35 s a call, twice a compile)."""
    signature, constexprs, attrs, options = jit_specialize(fn, launch, arch)
    spec = specialization_summary(signature, constexprs, attrs)
    key = json.dumps([launch.kernel, arch, spec], sort_keys=True)
    facts = cache.get(key)
    if facts is None:
        asm, log = compile_kernel(fn, arch, signature, constexprs, attrs, options)
        facts = {
            "ptx": ptx_accesses(asm["ptx"]),
            "cubin": asm["cubin"],
            "ptxas": ptxas_report(log),
            "narrow_int_ops": ttir_narrow_int_ops(asm["ttir"]),
            "ptx_target": ptx_target(asm["ptx"]),
        }
        cache[key] = facts
    if disassemble and "sass" not in facts:
        facts["sass"] = sass_accesses(sass_of(facts["cubin"]))
    threads = 32 * options.num_warps
    problems = []
    ptxas = facts["ptxas"]
    if ptxas.spill_store_bytes or ptxas.spill_load_bytes:
        problems.append(
            f"ptxas: register spills ({ptxas.spill_store_bytes} bytes stored, "
            f"{ptxas.spill_load_bytes} loaded, {ptxas.registers} registers)"
        )
    if facts["narrow_int_ops"]:
        problems.append(
            "TTIR: address math narrower than 64 bits (overflows past 2^31 elements): "
            + ", ".join(facts["narrow_int_ops"])
        )
    problems += width_problems(launch, "PTX", facts["ptx"], threads)
    sass = facts.get("sass") if disassemble else None
    if sass is not None:
        problems += width_problems(launch, "SASS", sass, threads)
    return {
        "label": launch.label,
        "kernel": launch.kernel,
        "case": launch.case,
        "arch": arch,
        "itemsize": launch.itemsize,
        "row_elems": launch.row_elems,
        "num_tokens": launch.num_tokens,
        "pool_rows": launch.pool_rows,
        "block_tokens": launch.block_tokens,
        "block_cols": launch.block_cols,
        "aligned": launch.aligned,
        "expect_vectors": launch.expect_vectors,
        "pool_align": launch.pool_align,
        "slab_align": launch.slab_align,
        **spec,
        "ptx": histogram(facts["ptx"]),
        "ptx_loop": histogram(loop_accesses(facts["ptx"]) or []),
        "sass": None if sass is None else histogram(sass),
        "sass_loop": None if sass is None else histogram(loop_accesses(sass) or []),
        "ptxas": asdict(ptxas),
        "narrow_int_ops": facts["narrow_int_ops"],
        "ptx_target": facts["ptx_target"],
        "problems": problems,
    }


def ptxas_version(arch: int) -> str:
    """The release line of the ptxas Triton uses for ``arch`` (ptxas-blackwell from sm_100)."""
    from triton.backends.nvidia.compiler import get_ptxas

    out = subprocess.run([get_ptxas(arch).path, "--version"], capture_output=True, text=True)
    return next((line for line in out.stdout.splitlines() if "release" in line), out.stdout)


def _widest_aligned(todo: list[Launch]) -> list[Launch]:
    """Per kernel and element width, the aligned launch with the widest column block."""
    widest: dict[tuple[str, int], Launch] = {}
    for launch in todo:
        key = (launch.kernel, launch.itemsize)
        if launch.case == "aligned" and (
            key not in widest or launch.block_cols > widest[key].block_cols
        ):
            widest[key] = launch
    return list(widest.values())


def run(
    module: ModuleType,
    archs: tuple[int, ...] = ARCHS,
    kernels: tuple[str, ...] = tuple(KERNELS),
    itemsizes: tuple[int, ...] = ITEMSIZES,
    sass: str = "some",
    progress: bool = False,
) -> dict[str, Any]:
    """Compile and check every launch for every target. ``sass``: "all", "none", or "some"
    (one aligned launch per kernel and element width, the widest tile; PTX covers all)."""
    todo = launches(module, kernels, itemsizes)
    if 2 in itemsizes:
        todo += [huge_pool_launch(module, k) for k in kernels]
    disassemble = {id(launch) for launch in _widest_aligned(todo)} if sass == "some" else set()
    t0 = time.perf_counter()
    records = []
    for arch in archs:
        cache: dict[str, Any] = {}
        for i, launch in enumerate(todo):
            fn = getattr(module, KERNELS[launch.kernel])
            wanted = sass == "all" or id(launch) in disassemble
            records.append(check_launch(fn, launch, arch, cache, wanted))
            if progress and (i + 1) % 50 == 0:
                print(f"  sm_{arch}: {i + 1}/{len(todo)}", file=sys.stderr, flush=True)
    return {
        "triton": triton.__version__,
        "ptxas": {f"sm_{arch}": ptxas_version(arch) for arch in archs},
        "module": module.__name__,
        "archs": list(archs),
        # what the launcher can pick, to compare with what was compiled
        "tiles": {
            path: {str(size): sorted(tiles(module, size, path == "aligned")) for size in itemsizes}
            for path in ("aligned", "unaligned")
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "records": records,
    }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", type=_ints, default=ARCHS, help="compute capabilities")
    ap.add_argument("--kernels", default="save,restore")
    ap.add_argument("--itemsizes", type=_ints, default=ITEMSIZES)
    ap.add_argument("--kernels-module", default="kernels.kv_copy_triton")
    ap.add_argument("--json-out", help="write every record (and the tile set) here")
    ap.add_argument(
        "--sass",
        choices=["all", "some", "none"],
        default="some",
        help="which launches to also check in SASS (cuobjdump, ~0.35 s each): 'some' = the "
        "widest aligned tile per kernel and element width",
    )
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter has no compiled kernels to check")
    module = importlib.import_module(args.kernels_module)
    kernels = tuple(args.kernels.split(","))
    report = run(module, args.archs, kernels, args.itemsizes, args.sass, progress=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    failed = [r for r in report["records"] if r["problems"]]
    for r in failed:
        for p in r["problems"]:
            print(f"FAIL sm_{r['arch']} {r['label']}: {p}")
    print(
        f"aot check ({args.kernels_module}, triton {report['triton']}): "
        f"{len(report['records'])} launches x targets compiled for "
        f"{', '.join(f'sm_{a}' for a in args.archs)} in {report['seconds']} s; "
        f"{len(failed)} failed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
