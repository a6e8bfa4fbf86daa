"""The KV copy kernels compiled ahead of time for sm_80, sm_90a and sm_100a, no GPU needed.

`python -m kernels.gpu_check.aot_check` runs in a subprocess (the kernels must be
JITFunctions, and this session runs Triton in its interpreter): every launch the launcher can
make, specialized as Triton's JIT would on a GPU, compiled to PTX and cubin by the bundled
ptxas. The tests below restate each property on the JSON it writes, and check that the checker
does fail on a de-vectorized kernel, on 32-bit offsets and on a tile that spills.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import triton

from kernels import kv_copy_triton
from kernels.gpu_check.aot_inspect import (
    Access,
    ptx_accesses,
    ptx_target,
    ptxas_report,
    sass_accesses,
    ttir_narrow_int_ops,
)

ROOT = Path(__file__).resolve().parents[2]
ARCHS = {80, 90, 100}
KERNEL_SOURCE = ROOT / "kernels" / "kv_copy_triton.py"


CHECKER_SOURCES = [
    *sorted((ROOT / "kernels").glob("*.py")),
    *sorted((ROOT / "kernels" / "gpu_check").glob("aot_*.py")),
]
# The checker's results, kept between runs (a full check compiles ~75 s on 2 cores), keyed by
# everything they depend on: the kernel and checker sources, the arguments, Triton's and torch's
# versions. APRIL_AOT_FRESH=1 compiles anew.
RESULTS_CACHE = Path(os.environ.get("APRIL_CACHE", Path.home() / ".cache" / "april-server"))


def _run_checker(
    tmp: Path, *args: str, module_dir: Path | None = None, json_out: Path | None = None
):
    sources = [*CHECKER_SOURCES, *(sorted(module_dir.glob("*.py")) if module_dir else [])]
    key = hashlib.sha256(
        repr((args, triton.__version__, torch.__version__)).encode()
        + b"".join(p.name.encode() + p.read_bytes() for p in sources)
    ).hexdigest()[:16]
    kept = RESULTS_CACHE / "aot-check" / key
    if (kept / "result.json").exists() and os.environ.get("APRIL_AOT_FRESH") != "1":
        result = json.loads((kept / "result.json").read_text())
    else:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (module_dir, ROOT) if p)
        env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")  # not the user's cache
        report = tmp / "aot-report.json"
        proc = subprocess.run(
            [sys.executable, "-m", "kernels.gpu_check.aot_check", *args, "--json-out", str(report)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        result = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        result["report"] = json.loads(report.read_text()) if report.exists() else None
        kept.mkdir(parents=True, exist_ok=True)
        (kept / "result.json").write_text(json.dumps(result))
    if json_out is not None and result["report"] is not None:
        json_out.write_text(json.dumps(result["report"]))
    return subprocess.CompletedProcess(
        args, result["returncode"], result["stdout"], result["stderr"]
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The full check (~75 s on 2 cores), once per session."""
    tmp = tmp_path_factory.mktemp("aot")
    out = tmp / "aot.json"
    proc = _run_checker(tmp, json_out=out)
    if not out.exists():
        pytest.fail(f"aot_check wrote no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    data["returncode"], data["output"] = proc.returncode, proc.stdout
    return data


def _fmt(records: list[dict[str, Any]], key: str) -> str:
    return "\n".join(f"sm_{r['arch']} {r['label']}: {r[key]}" for r in records[:20])


def _widths(hist: dict[str, int], op: str) -> list[int]:
    """{"ld128": 8, "st16": 4} -> the widths of op ("ld"/"st"), one entry per instruction."""
    return [int(k[2:]) for k, n in hist.items() if k.startswith(op) for _ in range(n)]


def test_checker_reports_no_failure(report):
    assert report["returncode"] == 0, report["output"][-5000:]
    assert not [r for r in report["records"] if r["problems"]]


def test_every_target_compiled_the_same_launches(report):
    by_arch: dict[int, list[str]] = {}
    for r in report["records"]:
        by_arch.setdefault(r["arch"], []).append(r["label"])
    assert set(by_arch) == ARCHS
    # Hopper and Blackwell get their arch-specific targets; sm_100a needs ptxas-blackwell.
    assert {r["ptx_target"] for r in report["records"]} == {"sm_80", "sm_90a", "sm_100a"}
    assert all("release" in v for v in report["ptxas"].values()), report["ptxas"]
    labels = [sorted(v) for v in by_arch.values()]
    assert all(v == labels[0] for v in labels) and len(labels[0]) > 100


def test_aligned_path_is_128_bit_vectors(report):
    # The column loop holds the copy; the 64-bit pointer table and slot id loads precede it.
    aligned = [r for r in report["records"] if r["expect_vectors"]]
    assert {r["itemsize"] for r in aligned} == {1, 2, 4, 8}
    assert {r["kernel"] for r in aligned} == {"save", "restore"}
    bad = []
    for r in aligned:
        for code in ("ptx_loop", "sass_loop"):
            if r[code] is None:  # SASS is read for the widest tile only
                continue
            widths = _widths(r[code], "ld") + _widths(r[code], "st")
            if not _widths(r[code], "st") or not _widths(r[code], "ld") or min(widths) < 128:
                bad.append({**r, "code": f"{code} {r[code]}"})
    assert not bad, _fmt(bad, "code")
    # SASS too, not only PTX: ptxas keeps the 128-bit accesses (LDG.E.128 / STG.E.128).
    assert {(r["arch"], r["itemsize"]) for r in aligned if r["sass"]} == {
        (a, s) for a in ARCHS for s in (1, 2, 4, 8)
    }


def test_unaligned_path_never_accesses_wider_than_the_memory_is_aligned(report):
    unaligned = [r for r in report["records"] if not r["expect_vectors"]]
    assert {r["case"] for r in unaligned} == {"row-unaligned", "pool-unaligned", "slab-unaligned"}
    bad = []
    for r in unaligned:
        load_align, store_align = (
            (r["pool_align"], r["slab_align"])
            if r["kernel"] == "save"
            else (r["slab_align"], r["pool_align"])
        )
        copy = r["ptx_loop"]
        if not copy:  # one-element rows: no loop; the 64-bit slot id loads count too
            copy, load_align = r["ptx"], max(load_align, 8)
        too_wide_store = max(_widths(copy, "st")) > 8 * store_align
        too_wide_load = max(_widths(copy, "ld")) > 8 * load_align
        if too_wide_store or too_wide_load:
            bad.append(r)
    assert not bad, _fmt(bad, "ptx")


def test_no_register_spills(report):
    spilled = [
        r
        for r in report["records"]
        if r["ptxas"]["spill_store_bytes"] or r["ptxas"]["spill_load_bytes"]
    ]
    assert not spilled, _fmt(spilled, "ptxas")
    assert all(r["ptxas"]["registers"] > 0 for r in report["records"])  # the log was parsed


def test_address_math_is_64_bit(report):
    narrow = [r for r in report["records"] if r["narrow_int_ops"]]
    assert not narrow, _fmt(narrow, "narrow_int_ops")


def test_pool_beyond_int32_specializes_like_a_small_one(report):
    # The launcher never passes the pool size: a 2.1G-element pool and a 2.7G-element slab
    # compile to the same kernel as a small launch, so the 64-bit math above covers them.
    for arch in ARCHS:
        for kernel in ("save", "restore"):
            same = [
                r
                for r in report["records"]
                if (r["arch"], r["kernel"]) == (arch, kernel)
                and r["case"] in ("huge-pool", "tokens-4096")
            ]
            assert len(same) == 2
            spec = [(r["signature"], r["constexprs"], r["divisible_16"], r["ptx"]) for r in same]
            assert spec[0] == spec[1]
            assert same[0]["signature"]["row_elems"] == "i32"  # a plain int: no pool size in it


def test_every_tile_the_launcher_can_pick_is_compiled(report, monkeypatch):
    monkeypatch.setattr(kv_copy_triton, "interpreting", lambda: False)  # the GPU tiles
    for itemsize in (1, 2, 4, 8):
        for aligned, cases in ((True, {"aligned"}), (False, {"row-unaligned"})):
            can_pick = {
                kv_copy_triton._geometry(row, itemsize, None, None, aligned)
                for row in range(1, 20_000)
                if (row % 16 == 0) == aligned
            }
            compiled = {
                (r["block_tokens"], r["block_cols"])
                for r in report["records"]
                if r["itemsize"] == itemsize and r["case"] in cases and r["arch"] == 90
            }
            assert compiled == can_pick, (itemsize, aligned)


class _Recorder:
    def __init__(self):
        self.kwargs = None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: setattr(self, "kwargs", kwargs)


@pytest.mark.parametrize(
    "row_elems,shift_pool,aligned",
    [(1024, False, True), (1016, False, False), (1024, True, False), (24, False, False)],
    ids=["real-row", "16-byte-row", "pool-off-by-one", "short-row"],
)
def test_launcher_takes_the_aligned_path_only_when_the_jit_can_see_it(
    row_elems, shift_pool, aligned
):
    flat = torch.empty(8 * row_elems + 1, dtype=torch.bfloat16)
    pool = flat[int(shift_pool) :][: 8 * row_elems].view(8, 1, row_elems)
    slab = torch.empty(2, 1, 4, 1, row_elems, dtype=torch.bfloat16)
    recorder = _Recorder()
    kv_copy_triton._launch(recorder, [pool, pool], torch.arange(4), slab, None, None)
    assert recorder.kwargs["ALIGNED"] is aligned


# ---- the checker itself must be able to fail -------------------------------------------------

MUTANTS = {
    # name: (source text, replacement, checker arguments, expected failure text)
    "devectorized": (
        "        src = tl.multiple_of(src, 16)\n",
        "        pass\n",
        ["--kernels", "save", "--itemsizes", "2"],
        "aligned path, but 64 of 64 loads",
    ),
    "32-bit-offsets": (
        "    src_rows = src + slots[:, None] * row_elems\n",
        "    src_rows = src + slots[:, None].to(tl.int32) * row_elems\n",
        ["--kernels", "save", "--itemsizes", "2"],
        "address math narrower than 64 bits",
    ),
    "spilling-tile": (
        "_GPU_UNALIGNED_TILE_ELEMS = 2048\n",
        "_GPU_UNALIGNED_TILE_ELEMS = 16384\n",
        ["--kernels", "restore", "--itemsizes", "1"],
        "register spills",
    ),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_checker_fails_on_a_broken_kernel(mutant, tmp_path):
    old, new, args, expected = MUTANTS[mutant]
    source = KERNEL_SOURCE.read_text()
    assert source.count(old) == 1, f"the kernel changed: update MUTANTS[{mutant!r}]"
    (tmp_path / "kv_copy_mutant.py").write_text(source.replace(old, new))
    proc = _run_checker(
        tmp_path,
        *("--kernels-module", "kv_copy_mutant", "--archs", "90", "--sass", "none", *args),
        module_dir=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout[-3000:]


# ---- parsers, on fixed text ------------------------------------------------------------------


def test_ptx_access_widths_and_loop():
    ptx = """
        ld.global.b64 %rd2, [%rd3];
        @%p9 bra $L__BB0_3;
    $L__BB0_2:
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        ld.global.L1::evict_last.b16 %rs1, [%rd7];
        @%p2 st.global.v2.b64 [ %rd4 + 0 ], { %rd5, %rd6 };
        ld.param.b32 %r9, [k_param_4];
        ld.shared.v4.b32 { %r1, %r2, %r3, %r4 }, [%r5];
        @%p19 bra $L__BB0_2;
    $L__BB0_3:
        st.global.b8 [%rd8], %rs2;
    """
    assert ptx_accesses(ptx) == [
        Access("ld", 64, in_loop=False),
        Access("ld", 128, in_loop=True),
        Access("ld", 16, in_loop=True),
        Access("st", 128, in_loop=True),
        Access("st", 8, in_loop=False),  # after the loop: a forward branch target
    ]
    assert ptx_accesses("ld.global.b64 %rd2, [%rd3];")[0].in_loop is False
    assert ptx_target("//\n.version 9.3\n.target sm_100a\n.address_size 64\n") == "sm_100a"


def test_sass_access_widths_and_loop():
    sass = """
        /*0220*/  @!P3 LDG.E.64 R20, desc[UR46][R2.64] ;
        /*0d80*/  IMAD.WIDE R2, R3, 0x2, R4 ;
        /*1140*/  @P4 LDG.E.128 R12, desc[UR46][R26.64] ;
        /*1150*/  @P4 STG.E.128 desc[UR46][R28.64], R12 ;
        /*1160*/  LDG.E.U16 R3, desc[UR4][R4.64] ;
        /*1170*/  STG.E desc[UR4][R6.64], R3 ;
        /*1180*/  LDS.128 R8, [R2] ;
        /*1570*/  BRA.U !UP0, 0xd80 ;
        /*1580*/  EXIT ;
        /*1590*/  BRA 0x1590;
    """
    assert sass_accesses(sass) == [
        Access("ld", 64, in_loop=False),
        Access("ld", 128, in_loop=True),
        Access("st", 128, in_loop=True),
        Access("ld", 16, in_loop=True),
        Access("st", 32, in_loop=True),
    ]


def test_ptxas_log():
    log = """ptxas info    : Compiling entry function '_kv_save_kernel' for 'sm_90a'
ptxas info    : Function properties for _kv_save_kernel
    24 bytes stack frame, 16 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 944 bytes cmem[0]
"""
    report = ptxas_report(log)
    assert (report.registers, report.stack_bytes) == (255, 24)
    assert (report.spill_store_bytes, report.spill_load_bytes) == (16, 20)
    with pytest.raises(ValueError, match="ptxas log"):
        ptxas_report("ptxas info    : 0 bytes gmem")


def test_ttir_narrow_integer_math():
    ttir = """
    %toks_4 = arith.muli %tok_block_0, %toks : i64 loc(#loc32)
    %src_rows_16 = arith.muli %src_rows, %src_rows_15 : tensor<8x1xi64> loc(#loc40)
    %bad = arith.muli %a, %b : tensor<8x1xi32> loc(#loc41)
    %t = arith.trunci %x : tensor<8xi64> to tensor<8xi32> loc(#loc42)
    %cols = arith.addi %c, %d : tensor<1024xi32> loc(#loc43)
    """
    assert ttir_narrow_int_ops(ttir) == ["arith.muli i32", "arith.trunci i64"]
