"""How long an `april-server` takes to answer `/health` and to stop, with SGLang's children
forked from the preloaded server (the CPU default) and with SGLang's plain `spawn`
(`APRIL_PRELOAD_CHILDREN=0`), in turn, on the embedded tiny model.

    python -m april_bench.startup [--repeat 3]

Each start is timed from the process's launch to its first `/health` 200 (polled every 0.1 s);
each stop from SIGTERM of its process group to its exit (the launcher's quiet stop).
"""

from __future__ import annotations

import argparse
import statistics
import time

from april_server.launcher import LaunchedServer

MODES = {"preloaded": {}, "spawn": {"APRIL_PRELOAD_CHILDREN": "0"}}


def time_one(env: dict[str, str]) -> tuple[float, float]:
    srv = LaunchedServer(env=env)
    t0 = time.monotonic()
    srv.spawn()
    srv.wait_healthy(poll_s=0.1)
    t1 = time.monotonic()
    srv.stop()
    return t1 - t0, time.monotonic() - t1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m april_bench.startup")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    got: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for i in range(args.repeat):  # interleaved: the machine's drift hits both alike
        for mode, env in MODES.items():
            got[mode].append(time_one(env))
            print(
                f"run {i} {mode}: healthy {got[mode][-1][0]:.1f} s, stop {got[mode][-1][1]:.1f} s"
            )
    print(f"{'children':<10} {'healthy s (median, min-max)':>30} {'stop s':>8}")
    for mode, runs in got.items():
        up = [r[0] for r in runs]
        down = [r[1] for r in runs]
        span = f"{statistics.median(up):.1f} ({min(up):.1f}-{max(up):.1f})"
        print(f"{mode:<10} {span:>30} {statistics.median(down):>8.1f}")
    ratio = statistics.median(r[0] for r in got["preloaded"]) / statistics.median(
        r[0] for r in got["spawn"]
    )
    print(f"preloaded / spawn time to healthy: x{ratio:.2f}")


if __name__ == "__main__":
    main()
