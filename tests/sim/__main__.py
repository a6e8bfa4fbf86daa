"""`python -m tests.sim [--seeds N] [--start S] [--seed S --verbose] [--no-faults]`: run seeds,
print seeds per second, and for the first failure its check, the clients' trace and the replay
command. Faults are on unless `--no-faults` (`faults.py`: then the simulator runs every seed
exactly as it did before faults existed). Runs itself again with PYTHONHASHSEED=0 (set
iteration order must not vary between runs)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from tests.sim.mutants import MUTANTS, mutant
from tests.sim.run import hash_seed_fixed, run_seed


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sim")
    ap.add_argument("--seeds", type=int, default=200, help="how many seeds")
    ap.add_argument("--start", type=int, default=0, help="the first seed")
    ap.add_argument("--seed", type=int, default=None, help="run just this seed")
    ap.add_argument("--verbose", action="store_true", help="print the trace and traceback")
    ap.add_argument("--keep-going", action="store_true", help="count every failing seed")
    ap.add_argument("--mutant", choices=sorted(MUTANTS), help="put a known bug back (mutants.py)")
    ap.add_argument(
        "--no-faults",
        action="store_true",
        help="inject no fault and drive no newer client: the seeds as they ran before faults",
    )
    args = ap.parse_args()
    if not hash_seed_fixed():
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "tests.sim", *sys.argv[1:]])
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    t0 = time.perf_counter()
    failed = []
    done = 0
    last = t0
    for seed in seeds:
        with mutant(args.mutant):
            failure = run_seed(seed, faults=not args.no_faults)
        done += 1
        if failure is not None:
            failed.append(failure)
            if len(failed) == 1 or args.verbose:
                print(f"seed {seed} FAILED: {failure.check}", flush=True)
                if args.verbose:
                    print(failure.plan)
                    print("\n".join(failure.trace[-60:]))
                    print(failure.detail)
                extra = f" --mutant {args.mutant}" if args.mutant else ""
                print(f"replay: {failure.replay()}{extra}", flush=True)
            if not args.keep_going:
                break
        now = time.perf_counter()
        if now - last > 10:
            rate = done / (now - t0)
            print(f"{done} seeds, {rate:.1f} seeds/s, {len(failed)} failed", flush=True)
            last = now
    wall = time.perf_counter() - t0
    print(
        f"simulated {done} seeds in {wall:.1f} s ({done / max(wall, 1e-9):.1f} seeds/s): "
        f"{len(failed)} failed" + (f" (first: seed {failed[0].seed})" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
