"""`python -m april_bench.fleet`: april-bench, unchanged, against one april-server and
against an owner over 1 and 2 engine servers (`--april-engines`), on the same machine and
cores, printed side by side.

Every layout gets the same CPU cores: the single server and the one engine run as many torch
threads as there are cores, two engines half as many each (`cli.cpu_share_env`), so "2
engines" measures what splitting one machine's cores between two schedulers does, not extra
hardware. The owner and the bench client share the machine too (`owner cpu s`: the owner's
CPU time over the whole bench, all modes). Arguments after `--` go to april-bench (default:
its `--quick` workload).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from april_server.cli import cpu_share_env
from april_server.launcher import LaunchedServer, start_all

from .sweep import median_cell, per_repeat_ratios

COLUMNS = [
    ("layout", "layout", "s"),
    ("mode", "mode", "s"),
    ("placement", "placement", "s"),
    ("out tok/s", "output_throughput", ".1f"),
    ("x sync", "x_sync", ".2f"),
    ("gen tok/s", "generated_throughput", ".1f"),
    ("to quota s", "mean_time_to_quota_s", ".2f"),
    ("rollout s", "rollout_wall_s", ".1f"),
    ("restored", "restored_kv_tokens", "d"),
    ("owner cpu s", "owner_cpu_s", ".1f"),
]


def bench(url: str, bench_args: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "bench.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "april_bench.cli",
            "--url",
            url,
            "--json-out",
            str(out),
            "--no-progress",
            *bench_args,
        ]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def run_layout(
    engines: int,
    bench_args: list[str],
    kv_bytes: str,
    threads: int | None = None,
    placements: Sequence[str] = ("least_loaded",),
    repeat: int = 1,
    model: str = "tiny",
    pin: bool = False,
) -> list[dict[str, Any]]:
    """engines = 0: one april-server, no owner; else an owner over that many engines, each
    with `threads` torch threads (default: an equal share of the cores); `pin`: each engine
    on its own share of the cores (as if on its own machine; owner and bench unpinned). With several
    `placements` (or repeats), one owner per placement in turn over the same engines, the
    order alternating between repeats; each record says its placement and repeat."""
    cores = sorted(os.sched_getaffinity(0))
    threads = threads or max(1, len(cores) // max(engines, 1))
    procs = [
        LaunchedServer(
            ["--april-kv-host-bytes", kv_bytes, "--april-model", model],
            env=cpu_share_env(threads),
            cpus=cores[i * threads : (i + 1) * threads] or None if pin else None,
        )
        for i in range(max(engines, 1))
    ]
    try:
        start_all(procs)
        if not engines:
            return bench(procs[0].url, bench_args)
        recs: list[dict[str, Any]] = []
        for rep in range(repeat):
            for placement in placements if rep % 2 == 0 else placements[::-1]:
                print(f"-- placement {placement}, repeat {rep + 1}", file=sys.stderr, flush=True)
                recs += [
                    {**r, "placement": placement, "repeat": rep}
                    for r in owner_bench(procs, placement, bench_args)
                ]
        return recs
    finally:
        for p in procs:
            p.stop()


def owner_bench(
    engines: Sequence[LaunchedServer], placement: str, bench_args: list[str]
) -> list[dict[str, Any]]:
    urls = ",".join(p.url for p in engines)
    owner = LaunchedServer(["--april-engines", urls, "--april-placement", placement])
    try:
        owner.start()
        recs = bench(owner.url, bench_args)
        if owner.proc is not None:  # what the owner took from the shared cores
            import psutil

            t = psutil.Process(owner.proc.pid).cpu_times()
            for r in recs:
                r["owner_cpu_s"] = round(t.user + t.system, 1)
        return recs
    finally:
        owner.stop()


def placement_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per layout and mode: each placement's output tok/s, median (min-max) over repeats, its
    ratio to the first placement's taken within each repeat, and the prediction error."""
    lines = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("placement"):
            groups.setdefault((r["layout"], r["mode"]), []).append(r)
    for (layout, mode), recs in groups.items():
        order = list(dict.fromkeys(r["placement"] for r in recs))
        for placement in order:
            runs = [r for r in recs if r["placement"] == placement]
            ratios = per_repeat_ratios(
                recs, placement, order[0], "output_throughput", field="placement"
            )
            errors = [r.get("length_prediction") or {} for r in runs]
            lines.append(
                f"{layout} {mode} {placement:>12}: "
                f"{median_cell(runs, 'output_throughput', '{:.1f}')} out tok/s"
                f"  x {order[0]} {median_cell(ratios, 'ratio', '{:.2f}')}"
                f"  prediction |error| {median_cell(errors, 'mean_abs_error_tokens', '{:.0f}')}"
                f" tokens ({len(runs)} runs)"
            )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    head = " ".join(f"{name:>12}" for name, _, _ in COLUMNS)
    lines = [head]
    for r in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            v = r.get(key)
            cells.append(f"{'-' if v is None else format(v, fmt):>12}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, _, rest = _split(argv)
    p = argparse.ArgumentParser(prog="python -m april_bench.fleet")
    p.add_argument("--layouts", default="0,1,2", help="0: one april-server; N: owner + N engines")
    p.add_argument("--kv-host-bytes", default=str(512 * 1024**2))
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument(
        "--threads-per-engine",
        type=int,
        default=None,
        help="torch threads of each engine (default: the cores split evenly between them)",
    )
    p.add_argument(
        "--placements",
        default="least_loaded",
        help="owner placements to compare over the same engines (e.g. least_loaded,tail)",
    )
    p.add_argument("--repeat", type=int, default=1, help="owner runs per placement, alternated")
    p.add_argument(
        "--pin-engines",
        action="store_true",
        help="each engine on its own cores (threads-per-engine of them), not sharing them",
    )
    p.add_argument(
        "--engine-model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="the engines' (and the single server's) model: smollm2 for --workload text",
    )
    args = p.parse_args(ours)
    placements = args.placements.split(",")
    bench_args = rest or ["--quick"]
    rows: list[dict[str, Any]] = []
    for layout in (int(x) for x in args.layouts.split(",")):
        name = "single" if layout == 0 else f"owner+{layout}"
        print(f"== {name} ==", file=sys.stderr, flush=True)
        recs = [
            r
            for r in run_layout(
                layout,
                bench_args,
                args.kv_host_bytes,
                args.threads_per_engine,
                placements,
                args.repeat,
                args.engine_model,
                args.pin_engines,
            )
            if r.get("mode")
        ]
        # sync of the same owner (placement) and repeat: the base of each record's ratio
        sync = {
            (q.get("placement"), q.get("repeat")): q.get("output_throughput")
            for q in recs
            if q["mode"] == "sync"
        }
        for r in recs:
            base = sync.get((r.get("placement"), r.get("repeat")))
            x = r.get("output_throughput")
            rows.append({**r, "layout": name, "x_sync": x / base if base and x else None})
    print(table(rows))
    if len(placements) > 1 or args.repeat > 1:
        print(placement_table(rows))
    if args.json_out is not None:
        with args.json_out.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def _split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], "--", argv[i + 1 :]
    return argv, "", []


if __name__ == "__main__":
    main()
