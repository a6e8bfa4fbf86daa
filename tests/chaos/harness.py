"""`make chaos`: random clients against a real april-server, checking nothing hangs or is lost.

    python -m tests.chaos --duration-s 600 --clients 6 --mode server
    python -m tests.chaos --duration-s 600 --mode owner   # 2 engines, one killed

Several clients at random send quota calls (plain; streamed; streamed and abandoned at a random
moment; retried later with the same `request_id`), duplicate group ids, aborts (all or named,
keep snapshot/tokens/drop), deletes, resumes, prefetches (`POST /groups` into the background or
idle, some sent twice with one `request_id`), weight pushes with and without
`abort_all_requests`, and reads; calls end with `on_quota` snapshot, tokens, drop or continue,
so background generation runs between them. Agent episodes: streamed calls whose groups end
turns at stop tokens, their tool answers posted at once, twice (the second must be refused), late
(after an abort of the group let the call go on), or never (the group aborted, left awaiting);
the drain answers what still awaits. In `owner` mode an owner drives two engine servers
and one of them is killed (-9) and restarted during the run. Then everything left is drained.
The ledger (`ledger.py`) checks: no request hangs, no 5xx (an owner's 503 `no_engine`
while no engine is healthy is counted apart), every acknowledged group delivered once or
deleted/dropped, none delivered twice, every delivered sample whole, and once drained the buffer
is empty and no snapshot bytes are held. The last line says it all; the exit status is 1 on any
failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from tests.chaos.client import CALL_TIMEOUT_S, Client, R
from tests.chaos.ledger import ChaosLedger
from tests.chaos.target import Target, launch, vocab_of

SWEEP_WAIT_S = 90.0  # an owner frees a leaked snapshot 30-50 s after it was made


async def killer(target: Target, until: float, led: ChaosLedger) -> None:
    """Owner mode: kill -9 one engine twice during the run, restarting it each time."""
    span = until - time.monotonic()
    for at in (span / 3, span / 3):
        await asyncio.sleep(at)
        led.ops["kill9"] += 1
        await asyncio.to_thread(target.restart_engine, 1)


async def settled(c: Client, timeout_s: float = 300.0) -> None:
    """Wait until no call runs (an abandoned call winds down after its client left)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        r = await c.http.get(R + "/stats")
        if r.status_code == 200 and not r.json()["active_calls"]:
            return
        await asyncio.sleep(0.5)
    c.led.hangs.append(f"calls still active {timeout_s:.0f} s after the clients stopped")


async def drain(c: Client, led: ChaosLedger) -> tuple[int, int]:
    """Resolve every abandoned call, stop everything, take every buffered group out."""
    await settled(c)
    for rid in list(c.pending):
        await c.retry(rid)
    await c._post(R + "/abort", {"all": True, "keep": "tokens"}, CALL_TIMEOUT_S)
    await settled(c)
    for _ in range(200):
        stats = (await c.http.get(R + "/stats")).json()
        left = int(stats["buffered_groups"])
        if not left:
            break
        if stats.get("awaiting_input_samples"):  # answered, so a call can take them out
            for g in await c.buffered():
                for s in g["samples"]:
                    if s["status"] == "awaiting_input":
                        await c.answer(s["sample_id"], len(s["turns"]))
        body = {"groups": [], "target_groups": min(left, 16), "on_quota": "tokens"}
        r = await c._post(R + "/rollouts", body, CALL_TIMEOUT_S)
        if r.status_code == 200:
            led.answered(None, r.json())
        else:
            await asyncio.sleep(1.0)  # e.g. no engine healthy yet
    await settled(c)
    stats = (await c.http.get(R + "/stats")).json()
    left = int(stats["buffered_groups"]) + int(stats.get("claimed_groups", 0))
    keys = ("running_samples", "awaiting_input_samples", "background_running_samples")
    led.left_over = {k: int(stats.get(k, 0) or 0) for k in keys}
    for gid in sorted(led.acknowledged - set(led.delivered) - led.gone)[:5]:
        r = await c.http.get(f"{R}/partials/{gid}")  # what the server says of a lost one
        led.story.setdefault(gid, []).append(f"now: GET /partials -> {r.status_code}")
    return left, await snapshots_after_sweep(c, led, stats)


async def snapshots_after_sweep(c: Client, led: ChaosLedger, stats: dict[str, Any]) -> int:
    """Snapshot bytes still held once the server's sweep (an owner's, `snapshot_sweep.py`)
    had the time to free what nobody refers to; the bytes held at the drain are recorded."""
    held = led.held_at_drain = int(stats.get("snapshot_bytes_used", 0) or 0)
    end = time.monotonic() + SWEEP_WAIT_S
    while held and "snapshot_sweeps" in stats and time.monotonic() < end:
        await asyncio.sleep(2.0)
        stats = (await c.http.get(R + "/stats")).json()
        held = int(stats.get("snapshot_bytes_used", 0) or 0)
    led.swept = int(stats.get("snapshots_swept", 0) or 0)
    return held


async def run(target: Target, duration_s: float, clients: int, seed: int) -> ChaosLedger:
    led = ChaosLedger()
    until = time.monotonic() + duration_s
    crowd = [Client(k, target, led, seed) for k in range(clients)]
    jobs = [c.run(until) for c in crowd]
    if target.engines:
        jobs.append(killer(target, until, led))
    await asyncio.gather(*jobs)
    for c in crowd[1:]:
        crowd[0].pending.update(c.pending)
    left, held = await drain(crowd[0], led)
    for c in crowd:
        await c.http.aclose()
    led.final = led.check(left, held, led.left_over)
    return led


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="april-chaos", description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--mode", choices=["server", "owner"], default="server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="an already running server (server mode only)")
    p.add_argument("--json-out", help="write the counts and failures here")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs of a pass too")
    args = p.parse_args(argv)
    if args.url:
        from april_server.models import ensure_tiny_model

        model = str(ensure_tiny_model())
        target = Target(args.url, model, vocab_of(model))
    else:
        print(f"chaos: launching ({args.mode}) ...", file=sys.stderr, flush=True)
        target = launch(args.mode)

    def keep_logs() -> None:
        for proc in target.procs:
            proc.keep_dir = True
            print(f"chaos: server log kept: {proc.log_path}", file=sys.stderr)

    try:
        led = asyncio.run(run(target, args.duration_s, args.clients, args.seed))
        if led.final or args.keep_logs:  # keep the servers' logs of a failed run
            keep_logs()
    except BaseException:  # a server gone, a harness bug: its log says why
        keep_logs()
        raise
    finally:
        for proc in target.procs:
            proc.stop()
    failed = led.final
    figures = {
        "mode": args.mode,
        "duration_s": args.duration_s,
        "clients": args.clients,
        "ops": sum(led.ops.values()),
        "by_op": dict(led.ops),
        "statuses": dict(led.statuses),
        "acknowledged": len(led.acknowledged),
        "delivered": len(led.delivered),
        "gone": len(led.gone),
        "no_engine_503": led.no_engine,
        "failures": failed,
        "snapshot_bytes_at_drain": led.held_at_drain,
        "snapshots_swept": led.swept,
        "tool_answers": dict(led.answers_taken),
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(figures, f, indent=1)
    for line in failed[:20]:
        print(f"chaos: FAIL {line}", file=sys.stderr)
    verdict = "FAIL" if failed else "PASS"
    print(
        f"chaos ({args.mode}): {figures['ops']} ops by {args.clients} clients in "
        f"{args.duration_s:.0f} s, statuses {dict(sorted(led.statuses.items()))}, "
        f"{len(led.acknowledged)} groups acknowledged, {len(led.delivered)} delivered, "
        f"{len(led.gone)} deleted or dropped, "
        f"tool answers {dict(sorted(led.answers_taken.items()))}, "
        f"{len(led.hangs)} hangs, "
        f"{led.held_at_drain} snapshot bytes held at the drain ({led.swept} swept), "
        f"{len(failed)} failed checks: {verdict}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
