"""`make bench-buffer`: the partial buffer at a million samples.

Part 1, in process (no model): the real store, manager and routes (through httpx's ASGI
transport) over an engine that generates instantly, so what is timed is the server's own
work, beside a synthetic buffer of `--samples` samples. A probe on the event loop measures
how long the loop is blocked (what every other request on the server would wait).
Part 2, end to end: a real `april-server` (SGLang on CPU, embedded tiny model) on the same
state dir; a thread polls `/health` while big calls run and reports p50/p99/max.

Figures are what this run measured on this machine; the aims are the issue's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from april_server.buffer.store import BufferStore
from april_server.buffer.synthetic import fill
from april_server.engine.base import BaseEngine
from april_server.http.app import create_router
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.inflight import EngineCapacity
from april_server.rules.samples import SegmentResult

R = "/april/v1"
BIG_CALLS, SMALL_CALLS = 3, 10  # end to end: enough polls for a p99
GROUP_SIZE = 4  # synthetic groups: 4 samples, prompt 16, 32 of 48 tokens generated


class InstantEngine(BaseEngine):
    """Generates `max_new_tokens` tokens at once (yielding to the loop once per segment) and
    reports SGLang-like limits, so admission works as on a real server."""

    def __init__(self) -> None:
        self.context_len, self.vocab_size = 8192, 448

    def weight_version(self) -> str:
        return "0"

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return [ord(c) % 448 for c in text]

    def check_sampling_params(self, params: dict[str, Any]) -> None:
        return None

    async def generate(self, rid: str, ids: list[int], params: dict[str, Any]) -> SegmentResult:
        await asyncio.sleep(0)
        k = int(params["max_new_tokens"])
        return SegmentResult([7] * k, [-0.1] * k, "length", "0")

    def abort(self, rid: str) -> None:
        return None

    async def capacity(self) -> EngineCapacity:
        return EngineCapacity(max_running_requests=256, max_total_tokens=1 << 20)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def new_groups(prefix: str, count: int, budget: int = 8) -> list[dict[str, Any]]:
    return [
        {
            "group_id": f"{prefix}-{i}",
            "input_ids": [5 + i % 200, 6, 7, 8],
            "n": 4,
            "sampling_params": {"max_new_tokens": budget, "ignore_eos": True, "temperature": 0},
        }
        for i in range(count)
    ]


@dataclass
class Table:
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, what: str, value: float, shown: str, aim: str = "") -> None:
        """`shown`: the figure as printed (a format string of `value`, or text)."""
        self.data[key] = value
        self.rows.append((what, shown.format(value), aim))

    def print(self, title: str) -> None:
        print(f"\n{title}\n")
        print("| measure | figure | aim |\n|---|---|---|")
        for what, fig, aim in self.rows:
            print(f"| {what} | {fig} | {aim} |")


class LoopProbe:
    """How late a 5 ms sleep wakes up: the longest time the event loop was blocked."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - t - 0.005)

    def start(self) -> None:
        self.lags.clear()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> float:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return max(self.lags, default=0.0)


async def timed(probe: LoopProbe, fn: Callable[[], Awaitable[Any]]) -> tuple[float, float, Any]:
    probe.start()
    t = time.perf_counter()
    out = await fn()
    wall = time.perf_counter() - t
    return wall, await probe.stop(), out


def in_process(state: Path, samples: int, add_groups: int) -> Table:
    t = Table()
    groups = samples // GROUP_SIZE
    print(f"building a synthetic buffer: {groups:,} groups x {GROUP_SIZE} ...", flush=True)
    t0 = time.perf_counter()
    store = BufferStore(state / "buffer.sqlite")
    fill(store, groups, n=4, prompt_len=16, output_len=32, budget=48)
    store.close()
    print(f"  built in {time.perf_counter() - t0:.1f} s", flush=True)

    rss0 = rss_bytes()
    t0 = time.perf_counter()
    durable = Durable.open(state / "buffer.sqlite")  # what a restarting server runs
    buffer = durable.buffer
    load_s = time.perf_counter() - t0
    per_sample = (rss_bytes() - rss0) / max(1, buffer.idle.samples)
    t.add(
        "restart_load_s",
        f"restart: load {buffer.idle.samples:,} samples",
        load_s,
        "{:.2f} s",
        "<= 10 s",
    )
    t.add("rss_per_sample_b", "RSS per buffered sample (index in memory)", per_sample, "{:.0f} B")
    mgr = RolloutManager(InstantEngine(), durable)
    app = FastAPI()
    app.include_router(create_router(lambda: mgr))

    async def go() -> None:
        probe = LoopProbe()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=600) as c:

            async def post(body: dict[str, Any]) -> httpx.Response:
                r = await c.post(R + "/rollouts", json=body)
                r.raise_for_status()
                return r

            body = {"groups": new_groups("add", add_groups), "resume_first": False}
            wall, stall, _ = await timed(probe, lambda: post(body))
            t.add(
                "add_call_s",
                f"call adding {add_groups:,} groups (server time)",
                wall,
                "{:.3f} s",
                "<= 1 s",
            )
            t.add(
                "add_call_loop_stall_s",
                "  longest event-loop stall during it",
                stall,
                f"{stall * 1e3:.0f} ms",
                "<= 200 ms",
            )
            walls, stalls, served = [], [], []
            for k in range(5):
                small = {"groups": new_groups(f"small{k}", 1)}  # default: resume_first
                w, stall, r = await timed(probe, functools.partial(post, small))
                walls.append(w)
                stalls.append(stall)
                served.append(r.json()["groups"][0]["group_id"])
            t.add(
                "small_call_s",
                "small call, default: 1 group sent, resumes the oldest "
                f"(median of 5; served {', '.join(served)})",
                statistics.median(walls),
                "{:.3f} s",
                "<= 50 ms",
            )
            t.add(
                "small_call_loop_stall_s",
                "  longest event-loop stall during them",
                max(stalls),
                f"{max(stalls) * 1e3:.0f} ms",
            )
            for name, url in [
                ("first /partials page (1000 groups)", R + "/partials?limit=1000"),
                ("/partials page at the middle", f"{R}/partials?limit=1000&cursor={groups // 2}"),
                (
                    "/partials filtered (weight_version=0, status=partial)",
                    R + "/partials?limit=1000&weight_version=0&status=partial",
                ),
                ("GET /stats", R + "/stats"),
            ]:
                w, stall, resp = await timed(probe, functools.partial(c.get, url))
                resp.raise_for_status()
                t.add(
                    name,
                    name,
                    w,
                    f"{w:.3f} s, {len(resp.content) / 1e6:.1f} MB, loop stall {stall * 1e3:.0f} ms",
                )
        mgr.store.close()

    asyncio.run(go())
    return t


def end_to_end(state: Path, add_groups: int) -> Table:
    from april_server.launcher import LaunchedServer

    t = Table()
    srv = LaunchedServer(keep_dir=True)
    shutil.rmtree(srv.dir)
    srv.dir = state.parent  # the launcher's state dir is <dir>/state
    srv.log_path = state.parent / "server.log"
    t0 = time.perf_counter()
    srv.start()
    t.add(
        "e2e_start_s", "server start (SGLang + buffer load)", time.perf_counter() - t0, "{:.1f} s"
    )
    polls: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            while not stop.is_set():
                t1 = time.perf_counter()
                h.get("/health").raise_for_status()
                polls.append((t1, time.perf_counter() - t1))
                time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    windows: list[tuple[float, float]] = []
    lag: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            stats = c.get(R + "/stats").json()
            t.add("e2e_buffered", "buffered samples at start", stats["buffered_samples"], "{:,}")
            poller.start()
            time.sleep(1.0)

            # Big calls, then default calls (resume_first: the oldest buffered first).
            def big(k: int) -> dict[str, Any]:
                groups = new_groups(f"e2e-add{k}", add_groups, budget=4)
                return {"groups": groups, "resume_first": False}

            def small(k: int) -> dict[str, Any]:
                return {"groups": new_groups(f"e2e-one{k}", 1, budget=4)}

            def alone(k: int) -> dict[str, Any]:
                return {"groups": new_groups(f"e2e-own{k}", 1, budget=4), "resume_first": False}

            plan: list[tuple[str, str, Callable[[int], dict[str, Any]], int]] = [
                (
                    "e2e_add_call_s",
                    f"call adding {add_groups:,} groups, resume_first false",
                    big,
                    BIG_CALLS,
                ),
                (
                    "e2e_default_call_s",
                    "default call beside the buffer, 1 group sent "
                    "(resumes the oldest: real generation)",
                    small,
                    SMALL_CALLS,
                ),
                (
                    "e2e_own_call_s",
                    "1-group call, resume_first false (its own 4 tokens)",
                    alone,
                    SMALL_CALLS,
                ),
            ]
            for key, what, make, repeat in plan:
                walls, started, peak, met = [], 0, 0, True
                for k in range(repeat):
                    a = time.perf_counter()
                    r = c.post(R + "/rollouts", json=make(k))
                    b = time.perf_counter()
                    r.raise_for_status()
                    windows.append((a, b))
                    st = r.json()["stats"]
                    walls.append(b - a)
                    started = max(started, st["num_started_groups"])
                    peak = max(peak, st["peak_running_samples"])
                    met = met and st["quota_met"]
                wall = statistics.median(walls)
                t.add(
                    key,
                    f"{what} (median of {repeat})",
                    wall,
                    f"{wall:.2f} s (max {max(walls):.2f}; quota met every time: {met}; at most "
                    f"{started} groups started, {peak} samples running)",
                )
            time.sleep(0.5)
            lag = c.get(R + "/stats").json()
    finally:
        stop.set()
        poller.join(timeout=30)
        srv.stop()
    during = [lat for ts, lat in polls if any(a <= ts <= b for a, b in windows)]
    if during:
        q = (
            statistics.quantiles(during, n=100, method="inclusive")
            if len(during) > 1
            else during * 99
        )
        t.add(
            "health_p50_ms",
            f"/health while calls ran ({len(during)} polls): p50",
            statistics.median(during) * 1e3,
            "{:.1f} ms",
        )
        t.add("health_p99_ms", "  p99", q[98] * 1e3, "{:.1f} ms", "<= 50 ms")
        t.add("health_max_ms", "  max", max(during) * 1e3, "{:.1f} ms", "<= 200 ms")
    # The server's own clock of its loop (`/stats`): a slow /health with a prompt loop is the
    # CPU (2 cores shared with the scheduler and this client), not blocking work on the loop.
    t.add(
        "loop_lag_p99_ms",
        "server's event-loop lag over the last minute: p99",
        lag["event_loop_lag_p99_s"] * 1e3,
        "{:.1f} ms",
    )
    t.add(
        "loop_lag_max_ms",
        "  max since the server started",
        lag["event_loop_lag_max_s"] * 1e3,
        "{:.1f} ms",
    )
    return t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m april_bench.buffer", description=__doc__)
    p.add_argument("--samples", type=int, default=1_000_000, help="buffered samples")
    p.add_argument("--add-groups", type=int, default=4000, help="groups sent by the big call")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end part")
    p.add_argument("--json-out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="april-bench-buffer-"))
    try:
        a = in_process(root / "state", args.samples, args.add_groups)
        a.print(f"In process: real store, manager and routes; {args.samples:,} buffered samples")
        out = {"in_process": a.data}
        if not args.no_e2e:
            b = end_to_end(root / "state", args.add_groups)
            b.print("End to end: april-server on the embedded tiny model (SGLang on CPU)")
            out["end_to_end"] = b.data
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
