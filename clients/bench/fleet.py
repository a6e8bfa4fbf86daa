"""`python -m april_client.bench.fleet`: april-bench, unchanged, against one april-server and
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
from pathlib import Path
from typing import Any

from april_server.cli import cpu_share_env

from .launcher import LaunchedServer

COLUMNS = [
    ("layout", "layout", "s"),
    ("mode", "mode", "s"),
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
        cmd = [sys.executable, "-m", "april_client.bench.cli", "--url", url, "--json-out",
               str(out), "--no-progress", *bench_args]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def run_layout(
    engines: int, bench_args: list[str], kv_bytes: str, threads: int | None = None
) -> list[dict[str, Any]]:
    """engines = 0: one april-server, no owner; else an owner over that many engines, each
    with `threads` torch threads (default: an equal share of the cores)."""
    threads = threads or max(1, len(os.sched_getaffinity(0)) // max(engines, 1))
    procs = [
        LaunchedServer(["--april-kv-host-bytes", kv_bytes], env=cpu_share_env(threads))
        for _ in range(max(engines, 1))
    ]
    try:
        for p in procs:
            p.start()
        url = procs[0].url
        if engines:
            owner = LaunchedServer(["--april-engines", ",".join(p.url for p in procs)])
            procs.append(owner)
            owner.start()
            url = owner.url
        recs = bench(url, bench_args)
        if engines and owner.proc is not None:  # what the owner took from the shared cores
            import psutil

            t = psutil.Process(owner.proc.pid).cpu_times()
            for r in recs:
                r["owner_cpu_s"] = round(t.user + t.system, 1)
        return recs
    finally:
        for p in procs:
            p.stop()


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
    p = argparse.ArgumentParser(prog="python -m april_client.bench.fleet")
    p.add_argument("--layouts", default="0,1,2", help="0: one april-server; N: owner + N engines")
    p.add_argument("--kv-host-bytes", default=str(512 * 1024**2))
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument(
        "--threads-per-engine",
        type=int,
        default=None,
        help="torch threads of each engine (default: the cores split evenly between them)",
    )
    args = p.parse_args(ours)
    bench_args = rest or ["--quick"]
    rows: list[dict[str, Any]] = []
    for layout in (int(x) for x in args.layouts.split(",")):
        name = "single" if layout == 0 else f"owner+{layout}"
        print(f"== {name} ==", file=sys.stderr, flush=True)
        recs = [
            r
            for r in run_layout(layout, bench_args, args.kv_host_bytes, args.threads_per_engine)
            if r.get("mode")
        ]
        sync = next((r for r in recs if r["mode"] == "sync"), None)
        for r in recs:
            base = None if sync is None else sync.get("output_throughput")
            x = r.get("output_throughput")
            rows.append({**r, "layout": name, "x_sync": x / base if base and x else None})
    print(table(rows))
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
