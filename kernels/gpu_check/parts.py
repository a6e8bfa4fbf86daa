"""The kernel parts of the GPU check (parity, KV GB/s, the ahead-of-time compile check), each
returning a JSON-able entry with a ``status``: "ok", "failed" or "not run: no CUDA". Device
parts record the exact commands they run (or would run), so a dry run shows them. They run
the kernels' own scripts only; the parts that start april-server and april-bench, and the
harness that runs them all, are `april_bench.gpu_check`."""

from __future__ import annotations

import json
import re
from typing import Any

from kernels.gpu_check.run import Context, child_env, run_cmd, shown

NO_CUDA = "not run: no CUDA"


def aot(ctx: Context) -> dict[str, Any]:
    out = ctx.out_dir / "aot.json"
    res = run_cmd(
        ctx.python("-m", "kernels.gpu_check.aot_check", "--json-out", str(out)),
        ctx.allow(300),
        child_env(interpret=False),
    )
    entry: dict[str, Any] = {"status": "ok" if res.ok else "failed", **res.summary()}
    if out.exists():
        records = json.loads(out.read_text())["records"]
        entry["results"] = {
            "launches_x_targets": len(records),
            "targets": [f"sm_{a}" for a in sorted({r["arch"] for r in records})],
            "failed": sum(bool(r["problems"]) for r in records),
            "max_registers": max(r["ptxas"]["registers"] for r in records),
            "report": str(out.relative_to(ctx.out_dir)),
        }
    return entry


def parity(ctx: Context) -> dict[str, Any]:
    """Bit-exact save/restore against the references: real kernels on CUDA (the full check and
    the kernel tests), the interpreter at tiny sizes on CPU."""
    if not ctx.cuda:
        cmd = ctx.python("-m", "kernels.bench_kv_copy", "--check", "--tiny", "--device", "cpu")
        res = run_cmd(cmd, ctx.allow(120), child_env(interpret=True))
        entry = {
            "status": "ok" if res.ok else "failed",
            "mode": "interpreter, tiny",
            **res.summary(),
        }
        entry["results"] = _check_counts(res.output)
        entry["on_cuda_would_run"] = [
            "python -m kernels.bench_kv_copy --check",
            "python -m pytest tests/kernels -q -p no:cacheprovider "
            "--ignore tests/kernels/test_aot.py",
        ]
        return entry
    check = run_cmd(ctx.python("-m", "kernels.bench_kv_copy", "--check"), ctx.allow(120))
    tests = run_cmd(
        ctx.python(
            "-m",
            "pytest",
            "tests/kernels",
            "-q",
            "-p",
            "no:cacheprovider",
            "--ignore",
            "tests/kernels/test_aot.py",
        ),
        ctx.allow(150),
    )
    passed = re.search(r"(\d+) passed", tests.output)
    return {
        "status": "ok" if check.ok and tests.ok else "failed",
        "results": {**_check_counts(check.output), "kernel_tests_passed": passed and passed[1]},
        "check": check.summary(),
        "kernel_tests": tests.summary(),
    }


def _check_counts(output: str) -> dict[str, Any]:
    m = re.search(r"check on (\w+): (\d+) cases, (\d+) failures", output)
    return {"cases": int(m[2]), "failures": int(m[3])} if m else {"cases": None}


def kv_bandwidth(ctx: Context) -> dict[str, Any]:
    """Save/restore GB/s at 128-16k tokens (Qwen3-4B and Llama-3.1-8B shapes, bf16) beside
    the pinned memcpy ceiling and SGLang's get_cpu_copy/load_cpu_copy, same run."""
    out = ctx.out_dir / "kv_bandwidth.json"
    cmd = ctx.python("-m", "kernels.bench_kv_copy", "--device", "cuda", "--json-out", str(out))
    if not ctx.cuda:
        return {"status": NO_CUDA, "command": shown(cmd)}
    res = run_cmd(cmd, ctx.allow(150))
    entry: dict[str, Any] = {"status": "ok" if res.ok else "failed", **res.summary()}
    if out.exists():
        entry["results"] = json.loads(out.read_text())
    return entry
