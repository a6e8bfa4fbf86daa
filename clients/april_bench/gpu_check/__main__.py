"""GPU readiness check: one command, one JSON file and one markdown table.

    scripts/gpu-check.sh [--dry-run] [--out DIR] [--budget-s 570] [--aot]

On one CUDA device (an H200 in mind; no network needed: the 8B-shaped model is a config
shipped in kernels/configs/ served with random weights, --load-format dummy), within the
budget, each part with its own timeout cut to what is left:

1. parity: the Triton kernels and the torch path bit-exact against the references
   (``bench_kv_copy --check``, then ``pytest tests/kernels``);
2. kv_bandwidth: save/restore GB/s vs the pinned memcpy ceiling and SGLang's
   get_cpu_copy/load_cpu_copy (``bench_kv_copy --device cuda``);
3. server: april-server on the 8B-shaped model, shared by 4 and 5;
4. resume: restore vs re-prefill for 1k/4k/16k-token partials after flush_cache;
5. april_bench: sync vs static (april@all) vs adaptive (april@auto) APRIL;
6. moe_routing: routing replay on the tiny MoE, the e2e routing tests on the device.

``--dry-run`` (also what runs without CUDA) does everything a CPU can: the config loads in
transformers and SGLang, the server and bench command lines parse, the ahead-of-time kernel
check (sm_80/90/100), kernel parity in the Triton interpreter at tiny sizes; every device part
is written as "not run: no CUDA" with the command it would run.

The kernel parts (parity, GB/s, AOT) live with the kernels (`kernels.gpu_check.parts`); the
parts that start april-server and run april-bench are `server_parts` here, above the server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from april_bench.gpu_check import server_parts
from april_bench.gpu_check.report import markdown
from april_bench.gpu_check.server_parts import DeviceRun
from kernels.gpu_check import parts as kernel_parts
from kernels.gpu_check.run import ROOT, Context

Part = Callable[[DeviceRun], dict[str, Any]]


def on_context(part: Callable[[Context], dict[str, Any]]) -> Part:
    """A part that needs only the run's context, not its server."""
    return lambda run: part(run.ctx)


def plan(run: DeviceRun, with_aot: bool) -> list[tuple[str, Part]]:
    steps: list[tuple[str, Part]] = [
        ("environment", on_context(server_parts.environment)),
        ("configs", on_context(server_parts.configs)),
    ]
    if with_aot:
        steps.append(("aot", on_context(kernel_parts.aot)))
    return steps + [
        ("parity", on_context(kernel_parts.parity)),
        ("kv_bandwidth", on_context(kernel_parts.kv_bandwidth)),
        ("server", server_parts.start_server),
        ("resume", server_parts.resume),
        ("april_bench", server_parts.april_bench),
        ("moe_routing", server_parts.moe_routing),
    ]


def run_part(run: DeviceRun, name: str, part: Part) -> dict[str, Any]:
    print(f"[gpu-check {time.monotonic() - run.ctx.started:5.0f}s] {name} ...", flush=True)
    t0 = time.monotonic()
    try:
        entry = part(run)
    except BaseException as exc:  # one broken part must not lose the others' figures
        if isinstance(exc, KeyboardInterrupt):
            raise
        entry = {"status": "failed", "error": "".join(traceback.format_exception(exc))[-3000:]}
    entry.setdefault("seconds", round(time.monotonic() - t0, 1))
    print(f"[gpu-check] {name}: {entry['status']} ({entry['seconds']} s)", flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU parts only, even with CUDA")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "gpu-check")
    ap.add_argument("--budget-s", type=float, default=570.0, help="whole run, all parts")
    ap.add_argument("--aot", action="store_true", help="AOT check on a device run too (CPU work)")
    args = ap.parse_args(argv)
    import torch

    cuda = bool(torch.cuda.is_available()) and not args.dry_run
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(dry_run=not cuda, cuda=cuda, out_dir=args.out, budget_s=args.budget_s)
    run = DeviceRun(ctx)
    report: dict[str, Any] = {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dry_run": ctx.dry_run,
        "budget_s": args.budget_s,
        "parts": {},
    }
    try:
        for name, part in plan(run, with_aot=ctx.dry_run or args.aot):
            report["parts"][name] = run_part(run, name, part)
    finally:
        server_parts.stop_server(run)
        report["total_s"] = round(time.monotonic() - ctx.started, 1)
        (args.out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / "gpu-check.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out / 'gpu-check.json'} and {args.out / 'gpu-check.md'}")
    failed = [n for n, e in report["parts"].items() if e["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
