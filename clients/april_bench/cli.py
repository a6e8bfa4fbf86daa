"""`april-bench`: the RL load tester that compares sync, APRIL and APRIL with KV snapshots.

april-bench --quick                       # launch the embedded default, compare all modes
april-bench --quick --train-s 2           # a trainer that trains 2 s per step, then pushes
april-bench --url http://host:30000 --steps 10 --groups 32 --n 8 --max-tokens 8192
april-bench --simulate                    # project the gain at 8xH200 scale (a model)
april-bench --simulate --sim-engines 1,2,4,8,16   # the same model at each engine count
april-bench --sweep                       # sync vs static vs adaptive APRIL on four configs
april-bench --agent --quick               # multi-turn agent workload: sync vs APRIL with turns
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from typing import Any

import httpx

from april_server.launcher import LaunchedServer

from . import agent
from . import simulate as sim
from .driver import DEFAULT_MODES, BenchConfig, ModeSpec
from .metrics import ModeResult
from .metrics import __doc__ as metrics_doc
from .options import parse_args
from .report import plot, records, summary_table, write_jsonl
from .server_api import BenchError
from .session import run_modes
from .sweep import (
    SWEEP_MODES,
    SweepPoint,
    repeat_order,
    sweep_points,
    sweep_table,
)


def config(args: argparse.Namespace) -> BenchConfig:
    if args.max_inflight not in ("all", "auto") and not args.max_inflight.isdigit():
        raise SystemExit("--max-inflight must be all, auto or a positive integer")
    train_time, bump, step_versions = args.train_time, args.bump_version, False
    auto = args.train_s == "auto"
    if args.train_s is not None:
        if not auto and args.train_s < 0:
            raise SystemExit("--train-s must be >= 0")
        if args.train_time and (auto or args.train_time != args.train_s):
            raise SystemExit("--train-s sets the training time: drop --train-time")
        train_time, bump, step_versions = (0.0 if auto else args.train_s), True, True
    return BenchConfig(
        steps=args.steps,
        groups=args.groups,
        n=args.n,
        over_sampling=args.over_sampling,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        train_time=train_time,
        train_auto=auto,
        bump_version=bump,
        step_versions=step_versions,
        max_inflight=args.max_inflight,
        max_staleness=args.max_staleness,
        stream_sync=args.stream_sync,
        poll_hz=args.poll_hz,
        run_tag=f"bench{uuid.uuid4().hex[:6]}",
        keep_buffer=args.keep_buffer,
        interleave=args.interleave,
        size_pool=args.size_pool,
    )


def simulation(
    args: argparse.Namespace, measured: list[ModeResult], meta: dict[str, Any] | None
) -> None:
    modes = ["sync", "april", "april-kv"]
    probed = (meta or {}).get("cost_model")
    if probed:
        cost = sim.CostModel(**{**probed, "assumptions": tuple(probed["assumptions"])})
        local = sim.SimSetup(
            steps=args.steps,
            groups=args.groups,
            n=args.n,
            over_sampling=args.over_sampling,
            max_tokens=args.max_tokens,
            engines=1,
            prompt_len=40,
            seed=args.seed,
        )
        print("\n== simulated replay of this run's setup, cost model measured on its server ==")
        print(sim.report(local, cost, modes))
        recs = records(measured, {})
        seen = ", ".join(
            f"{r['mode']} x{r['output_throughput_vs_sync']}"
            for r in recs
            if r.get("output_throughput_vs_sync")
        )
        print(f"measured in this run (vs sync): {seen or 'n/a'}")
        sync = next((r for r in measured if r.mode == "sync" and r.steps), None)
        if sync is not None:
            print(f"cross-check, fit to the sync steps' walls: {sim.calibrate(sync.steps)[1]}")
    cost = sim.H200_8B
    if args.sim_a_ms is not None or args.sim_c_ms is not None:
        cost = sim.CostModel(
            "given constants",
            a=(args.sim_a_ms or cost.a * 1e3) / 1e3,
            c=(args.sim_c_ms or cost.c * 1e3) / 1e3,
            prefill_s=cost.prefill_s,
            restore_s=cost.restore_s,
            assumptions=cost.assumptions[2:],
        )
    per_engine = None if args.sim_groups is not None else args.sim_groups_per_engine
    k = args.sim_groups or args.sim_groups_per_engine * args.sim_engines[0]
    big = sim.SimSetup(
        steps=args.sim_steps,
        groups=k,
        n=args.sim_n,
        over_sampling=args.over_sampling,
        max_tokens=args.sim_max_tokens,
        engines=args.sim_engines[0],
        seed=args.seed,
        routing=args.sim_routing,
    )
    print("\n== projection at scale ==")
    print(sim.report(big, cost, modes, args.sim_engines, per_engine))


def mode_specs(args: argparse.Namespace, sweep: bool = False) -> list[ModeSpec]:
    text = args.modes or (SWEEP_MODES if sweep else ",".join(DEFAULT_MODES))
    try:
        specs = [ModeSpec.parse(m, args.max_inflight) for m in text.split(",") if m.strip()]
    except BenchError as exc:
        raise SystemExit(str(exc)) from None
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels) or not specs:
        raise SystemExit(f"--modes {text!r}: name each mode once, at least one")
    if args.interleave and sum(s.kind != "sync" for s in specs) > 1:
        raise SystemExit("--interleave takes sync and one APRIL mode: APRIL modes share the buffer")
    if args.interleave and any(s.kind == "april-async" for s in specs):
        raise SystemExit(
            "--interleave cannot take april-async: it generates between its calls, so it would "
            "load the other mode's steps"
        )
    if args.train_s == "auto" and specs[0].kind != "sync":
        raise SystemExit(
            "--train-s auto trains as long as sync's rollout: put sync first in --modes"
        )
    return specs


def measure(
    args: argparse.Namespace,
    specs: list[ModeSpec],
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[int, list[dict[str, Any]], list[ModeResult], dict[str, Any]]:
    """One comparison on one server: print its table; (status, records, results, run info).
    Status 1: an accounting check failed; 2: the run could not be made."""
    cfg = config(args)
    server: LaunchedServer | None = None
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    try:
        url = args.url
        if url is None:
            extra = ["--april-model", args.model, *args.server_arg]
            server = LaunchedServer(extra)
            print(
                f"launching april-server ({' '.join(extra)}) on {server.url} ...",
                file=sys.stderr,
                flush=True,
            )
            server.start()
            print(f"server healthy after {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            url = server.url
        results, meta = asyncio.run(run_modes(url, specs, cfg, args, transport))
    except BenchError as exc:
        print(f"april-bench: {exc}", file=sys.stderr)
        return 2, [], [], {}
    finally:
        if server is not None:
            server.stop()
    load = (round(load0, 2), round(os.getloadavg()[0], 2))
    run_info: dict[str, Any] = {
        **meta,
        "wall_clock_s": round(time.perf_counter() - t0, 1),
        "cpu_count": os.cpu_count(),
        "loadavg_1m_start_end": load,
    }
    recs = records(results, run_info)
    print(f"\n{meta['title']}")
    print(summary_table(recs))
    print(
        f"total time {run_info['wall_clock_s']:.0f}s (server start-up included); 1-min load "
        f"average {load[0]} -> {load[1]} on {os.cpu_count()} CPUs (other work skews figures)"
    )
    failed = any(r.checks for r in results) or bool(meta["mode_checks"])
    return int(failed), recs, results, run_info


def run(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None) -> int:
    """Measure, print, write outputs; exit status 1 when an accounting check failed."""
    status, recs, results, run_info = measure(args, mode_specs(args), transport)
    if status == 2:
        return 2
    if args.json_out:
        write_jsonl(args.json_out, recs)
        print(f"wrote {args.json_out}")
    if args.plot_dir:
        for path in plot(results, args.plot_dir, run_info["title"]):
            print(f"wrote {path}")
    if args.simulate:
        simulation(args, results, run_info)
    return status


def run_sweep(args: argparse.Namespace) -> int:
    """Each configuration on its own launched server, then the side-by-side table."""
    if args.url is not None:
        raise SystemExit("--sweep launches a server per configuration (models differ): drop --url")
    specs = mode_specs(args, sweep=True)
    points = sweep_points(args.sweep, args.sweep_point)
    done: list[tuple[SweepPoint, list[dict[str, Any]]]] = []
    status = 0
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    by_label = {s.label: s for s in specs}
    for i, point in enumerate(points):
        one = argparse.Namespace(
            **{
                **vars(args),
                "model": point.model,
                "max_tokens": point.max_tokens,
                "groups": point.groups,
                "n": point.n,
            }
        )
        point_recs: list[dict[str, Any]] = []
        for rep in range(args.repeat):
            order = repeat_order(list(by_label), rep)
            tag = (
                f" (repeat {rep + 1}/{args.repeat}: {', '.join(order)})" if args.repeat > 1 else ""
            )
            print(f"\n=== sweep {i + 1}/{len(points)}: {point.name}{tag} ===", flush=True)
            rc, recs, results, run_info = measure(one, [by_label[m] for m in order])
            status = max(status, rc)
            for rec in recs:
                rec["sweep_point"], rec["repeat"] = point.name, rep
            point_recs += recs
            if args.json_out:
                write_jsonl(args.json_out, recs)
            if args.plot_dir and results:
                sub = args.plot_dir / point.name.replace(":", "_")
                if args.repeat > 1:
                    sub = sub / f"repeat{rep + 1}"
                for path in plot(results, sub, run_info["title"]):
                    print(f"wrote {path}")
        done.append((point, point_recs))
    labels = ", ".join(s.label for s in specs)
    reps = f"; median (min-max) of {args.repeat} runs" if args.repeat > 1 else ""
    cfg = config(args)
    wall = bool(cfg.train_time) or cfg.train_auto
    trains = "sync's rollout time in" if cfg.train_auto else f"{cfg.train_time:g} s"
    what = (
        f"consumed tokens per wall second, {trains} training per step included"
        if wall
        else "consumed-token throughput"
    )
    print(
        f"\n== sweep: {what} vs sync ({labels}; {args.steps} steps, "
        f"over-sampling {args.over_sampling}, seed {args.seed}{reps}) =="
    )
    print(sweep_table(done, wall=wall))
    if args.json_out:
        print(f"wrote {args.json_out}")
    return status


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.help_metrics:
        print(metrics_doc)
        return
    if args.agent:
        sys.exit(agent.main(args))
    if args.sweep or args.sweep_point:
        sys.exit(run_sweep(args))
    if args.simulate and args.url is None and not args.launch and not args.quick:
        config(args)
        simulation(args, [], None)
        return
    sys.exit(run(args))


if __name__ == "__main__":
    main()
