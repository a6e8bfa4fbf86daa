"""`april-bench`'s command line: its options, their checks and the `--quick` preset."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import agent
from . import simulate as sim
from .driver import DEFAULT_MODES, MODES
from .sweep import PRESETS, SWEEP_MODES

QUICK: dict[str, Any] = {
    "steps": 6, "groups": 8, "n": 4, "max_tokens": 512, "over_sampling": 2.0,
    "bump_version": True,
}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="april-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--url", help="an april-server to use; without it one is launched (--launch)")
    a("--launch", action="store_true", help="start `python -m april_server` (default w/o --url)")
    a("--model", choices=["tiny", "smollm2"], default="tiny", help="launched server's model")
    a(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for the launched server (repeat; e.g. --server-arg=--load-format=dummy)",
    )
    a(
        "--modes",
        default=None,
        help=f"comma-separated modes from {','.join(MODES)}; an APRIL mode may name its "
        "max_inflight_groups policy: april@auto, april@all, april-kv@16 (default: "
        f"{','.join(DEFAULT_MODES)}; with --sweep {SWEEP_MODES})",
    )
    a(
        "--quick",
        action="store_true",
        help="small comparison of all modes (explicit flags still win): "
        + ", ".join(f"{k}={v}" for k, v in QUICK.items()),
    )
    a("--steps", type=int, default=4)
    a("--groups", type=int, default=8, help="K: groups consumed per step")
    a("--n", type=int, default=4, help="samples per group")
    a("--over-sampling", type=float, default=2.0, help="APRIL: in-flight groups = this x K")
    a("--max-tokens", type=int, default=512)
    a("--temperature", type=float, default=1.0)
    a(
        "--train-s",
        type=train_seconds,
        default=None,
        metavar="S",
        help="stand in for the trainer between calls: wait S seconds, then push the same weights "
        "(/update_weights_from_disk) with weight_version = the step number; april-async "
        "generates meanwhile. Sets --train-time S and --bump-version. 'auto': as long as sync's "
        "rollout (each sync step its own, the other modes sync's mean; sync must run first)",
    )
    a(
        "--train-time",
        type=float,
        default=0.0,
        help="simulated training seconds per step "
        "(older spelling; --train-s also names versions by step)",
    )
    a(
        "--bump-version",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reload the same weights under a new weight_version after each step (stale KV "
        "snapshots are then not restored unless the server allows stale reuse)",
    )
    a("--seed", type=int, default=0)
    a(
        "--workload",
        choices=["longtail", "jsonl", "natural", "text"],
        default="longtail",
        help="text: HumanEval prompts on SmolLM2, lengths set by the model (needs --model "
        "smollm2); --prompts of them, revisited across steps as RL epochs do",
    )
    a("--prompts", type=int, default=8, help="distinct prompts of --workload text")
    a("--lengths-file", type=Path, help="JSONL budgets for --workload jsonl")
    a("--max-inflight", default="all", help="APRIL max_inflight_groups: all | auto | N")
    a("--max-staleness", type=int, default=None)
    a(
        "--size-pool",
        action="store_true",
        help="every APRIL mode under max_inflight auto holds as many groups as the server's "
        "last stats.groups_wanted advised (over-sampling x K until it advises): the pool the "
        "server sizes for fresh tokens",
    )
    a(
        "--stream-sync",
        action="store_true",
        help="stream sync /generate to measure TTFT/TPOT/ITL (adds client and server work)",
    )
    a("--poll-hz", type=float, default=20.0, help="running-batch sampling rate (0 = off)")
    a("--warmup", type=int, default=1, help="warm-up rounds before measuring")
    a(
        "--bound-s",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds to measure the engine's saturated throughput before the modes (the bound "
        "every mode's 'x bound' is a fraction of: a closed-loop backlog of the workload at "
        "concurrency 8, 16, ... up to what the engine holds); 0 = skip",
    )
    a("--json-out", type=Path, help="append one JSON line per mode")
    a("--plot-dir", type=Path, help="write running_requests.png and step_throughput.png")
    a("--clear-buffer", action="store_true", help="delete every buffered group first")
    a("--keep-buffer", action="store_true", help="leave the leftover partial buffer in place")
    a(
        "--interleave",
        action="store_true",
        help="alternate the modes step by step (sync and ONE APRIL mode: APRIL modes would resume "
        "each other's buffered groups), so background load hits both alike",
    )
    a(
        "--sweep",
        action="store_true",
        help="run the comparison on each of: "
        + ", ".join(p.name for p in PRESETS)
        + " (MODEL:MAX_TOKENS:GROUPSxN; one launched server each) and print them side by side",
    )
    a(
        "--sweep-point",
        action="append",
        default=[],
        metavar="SPEC",
        help="add a sweep configuration, e.g. tiny:2048:8x8 (alone: sweep only these)",
    )
    a(
        "--repeat",
        type=int,
        default=1,
        metavar="R",
        help="with --sweep: measure each configuration R times (a fresh server each, the APRIL "
        "modes' order reversed every other time) and print median (min-max)",
    )
    a("--no-progress", action="store_true")
    a("--help-metrics", action="store_true", help="print how every figure is defined")
    g = p.add_argument_group("simulation")
    g.add_argument(
        "--simulate",
        action="store_true",
        help="project the gain at scale with a discrete-event model",
    )
    g.add_argument(
        "--sim-engines",
        type=engine_counts,
        default=[8],
        metavar="E[,E...]",
        help="engines (or DP ranks); a comma list (1,2,4,8,16) prints one row per count and mode",
    )
    g.add_argument(
        "--sim-groups-per-engine",
        type=positive_int,
        default=4,
        metavar="G",
        help="weak scaling (the default): K = G x engines groups per step, so every engine count "
        "gets the same load per engine (4 x 8 engines = 32, the former fixed default)",
    )
    g.add_argument(
        "--sim-groups",
        type=positive_int,
        default=None,
        metavar="K",
        help="strong scaling instead: K groups per step at every engine count (small K starves "
        "many engines)",
    )
    g.add_argument(
        "--sim-routing",
        choices=sim.ROUTINGS,
        default="least_loaded",
        help="least_loaded: april-server's placement (a resumed april-kv sample on the engine "
        "holding its snapshot, the rest on the least loaded engine); round_robin: the earlier "
        "model, for comparison (an april-kv resume elsewhere re-prefills)",
    )
    g.add_argument("--sim-n", type=int, default=8)
    g.add_argument("--sim-max-tokens", type=int, default=16384)
    g.add_argument("--sim-steps", type=int, default=20)
    g.add_argument("--sim-a-ms", type=float, help="fixed ms per decode iteration")
    g.add_argument("--sim-c-ms", type=float, help="ms per running sequence per iteration")
    agent.add_arguments(p)
    return p


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive integer")
    return value


def engine_counts(text: str) -> list[int]:
    """`8` or `1,2,4,8,16`: engine counts, each positive, each once."""
    counts = [positive_int(x.strip()) for x in text.split(",")]
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"{text!r}: name each engine count once")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`--quick` changes the defaults; flags given explicitly still win."""
    p = parser()
    first = p.parse_args(argv)
    if first.agent:
        p.set_defaults(**agent.agent_defaults(first.quick))
    elif first.quick:
        p.set_defaults(**QUICK)
    return p.parse_args(argv)


def train_seconds(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds or 'auto', not {text!r}") from None
