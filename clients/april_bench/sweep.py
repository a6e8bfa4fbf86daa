"""`april-bench --sweep`: the same comparison over several configurations, one launched server
each, then one table with every configuration's ratios side by side.

With `--repeat R` each configuration is measured R times, each on a fresh server, the APRIL
modes' order reversed every other time (so a "runs last" effect cancels), and every cell of the
table is the median with the range over the repeats: on a small shared machine one run's ratio
moves by +-20 %, so a single figure would mislead.

A point is written `MODEL:MAX_TOKENS:GROUPSxN`, e.g. `tiny:512:8x4` or `smollm2:128:4x4`. The
presets are the four configurations of the adaptive over-provisioning issue: where static APRIL
gains (small running batch on a small model) and where it loses (saturated or compute-bound).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .server_api import BenchError

SWEEP_MODES = "sync,april@all,april@auto"
_POINT = re.compile(r"^(tiny|smollm2):(\d+):(\d+)x(\d+)$")


@dataclass(frozen=True)
class SweepPoint:
    model: str
    max_tokens: int
    groups: int
    n: int

    @classmethod
    def parse(cls, text: str) -> SweepPoint:
        m = _POINT.match(text.strip())
        if m is None:
            raise BenchError(
                f"sweep point {text!r}: write MODEL:MAX_TOKENS:GROUPSxN with MODEL tiny or "
                "smollm2, e.g. tiny:512:8x4"
            )
        point = cls(m[1], int(m[2]), int(m[3]), int(m[4]))
        if min(point.max_tokens, point.groups, point.n) < 1:
            raise BenchError(f"sweep point {text!r}: every number must be at least 1")
        return point

    @property
    def name(self) -> str:
        return f"{self.model}:{self.max_tokens}:{self.groups}x{self.n}"


ISSUE_CONFIGS = ("tiny:512:8x4", "tiny:1024:8x4", "tiny:512:16x4", "smollm2:128:4x4")
PRESETS: tuple[SweepPoint, ...] = tuple(SweepPoint.parse(p) for p in ISSUE_CONFIGS)


def sweep_points(use_presets: bool, named: Sequence[str]) -> list[SweepPoint]:
    """The presets (with `--sweep`) followed by the user's points, without repeats."""
    points = list(PRESETS) if use_presets else []
    for text in named:
        p = SweepPoint.parse(text)
        if p not in points:
            points.append(p)
    return points


def repeat_order(labels: Sequence[str], repeat: int) -> list[str]:
    """Mode order of repeat `repeat` (0-based): sync first, the others reversed every other time."""
    first = [m for m in labels if m == "sync"]
    rest = [m for m in labels if m != "sync"]
    return first + (rest[::-1] if repeat % 2 else rest)


def sweep_table(
    results: Sequence[tuple[SweepPoint, list[dict[str, Any]]]], wall: bool = False
) -> str:
    """One row per configuration: sync throughput, then each other mode's tok/s and ratio; with
    several repeats of a configuration (records with the same mode), median (min-max).

    `wall`: consumed tokens per wall second *including* the simulated training (`--train-s`),
    the end-to-end figure, instead of per rollout second. There `april-async` also gets its
    ratio to `april`, taken within each repeat (same server, same load) before the median,
    and every mode its ratio to sync over the steps after the first (`steady x sync`)."""
    key, unit = ("wall_throughput", "wall tok/s") if wall else ("output_throughput", "tok/s")
    labels: list[str] = []
    for _, recs in results:
        for r in recs:
            if r["mode"] != "sync" and r["mode"] not in labels:
                labels.append(r["mode"])
    vs_april = wall and "april-async" in labels and "april" in labels
    # Tail-aware APRIL against today's APRIL under the same in-flight policy, per repeat.
    tail_base = {
        t: t.replace("april-tail", "april", 1) for t in labels if t.startswith("april-tail")
    }
    tail_base = {t: b for t, b in tail_base.items() if b in labels}
    # The engine's bound, measured in each run (`bound.py`): every mode's fraction of it.
    bounded = any(r.get("bound_tok_s") for _, recs in results for r in recs)
    head = ["configuration"] + (["bound tok/s"] if bounded else []) + [f"sync {unit}"]
    head += ["sync x bound"] if bounded else []
    for label in labels:
        head += [f"{label} {unit}", "x sync"] + (["steady x sync"] if wall else [])
        head += ["x bound", "thrown %"] if bounded else []
        if "auto" in label:
            head.append("running target")
        if vs_april and label == "april-async":
            head.append("x april")
        if label in tail_base:
            head.append(f"x {tail_base[label]}")
    head.append("checks")
    rows = [head]
    for point, recs in results:
        by_mode: dict[str, list[dict[str, Any]]] = {}
        for r in recs:
            by_mode.setdefault(r["mode"], []).append(r)
        sync = by_mode.get("sync", [])
        row = [point.name] + ([median_cell(sync, "bound_tok_s", "{:.0f}")] if bounded else [])
        row.append(median_cell(sync, key, "{:.1f}"))
        row += [median_cell(sync, "output_throughput_vs_bound", "{:.2f}")] if bounded else []
        for label in labels:
            runs = by_mode.get(label, [])
            row += [
                median_cell(runs, key, "{:.1f}"),
                median_cell(runs, f"{key}_vs_sync", "x{:.2f}"),
            ]
            if wall:
                row.append(median_cell(runs, "steady_wall_throughput_vs_sync", "x{:.2f}"))
            if bounded:
                row.append(median_cell(runs, "output_throughput_vs_bound", "{:.2f}"))
                row.append(median_cell(runs, "thrown_away_share", "{:.1%}"))
            if "auto" in label:
                row.append(_targets(runs))
            if vs_april and label == "april-async":
                row.append(
                    median_cell(
                        per_repeat_ratios(recs, "april-async", "april", key), "ratio", "x{:.2f}"
                    )
                )
            if label in tail_base:
                row.append(
                    median_cell(
                        per_repeat_ratios(recs, label, tail_base[label], key), "ratio", "x{:.2f}"
                    )
                )
        ok = all(r.get("checks_ok", True) for r in recs if r.get("available"))
        row.append("ok" if ok and recs else "FAIL")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def per_repeat_ratios(
    recs: Sequence[dict[str, Any]], mode: str, base: str, key: str, field: str = "mode"
) -> list[dict[str, Any]]:
    """`mode`'s `key` over `base`'s (records told apart by `field`), one per repeat where
    both were measured."""
    by_repeat: dict[Any, dict[str, float]] = {}
    for r in recs:
        if r.get(key):
            by_repeat.setdefault(r.get("repeat", 0), {})[r[field]] = float(r[key])
    return [{"ratio": m[mode] / m[base]} for m in by_repeat.values() if mode in m and base in m]


def median_cell(runs: Sequence[dict[str, Any]], key: str, fmt: str) -> str:
    """Median (min-max) of `key` over the runs; the value alone for one run."""
    values = [float(r[key]) for r in runs if r.get(key) is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return fmt.format(values[0])
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(lo)}-{fmt.format(hi)})"


def _targets(runs: Sequence[dict[str, Any]]) -> str:
    """The running target of every step (one run), or median (min-max) over repeats' steps."""
    per_run = [r.get("inflight_targets") or [] for r in runs]
    if len(per_run) == 1:
        return "/".join(str(t) for t in per_run[0]) or "n/a"
    flat = [t for targets in per_run for t in targets]
    if not flat:
        return "n/a"
    return f"{statistics.median(flat):g} ({min(flat)}-{max(flat)})"
