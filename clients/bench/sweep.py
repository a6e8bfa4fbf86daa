"""`april-bench --sweep`: the same comparison over several configurations, one launched server
each, then one table with every configuration's ratios side by side.

A point is written `MODEL:MAX_TOKENS:GROUPSxN`, e.g. `tiny:512:8x4` or `smollm2:128:4x4`. The
presets are the four configurations of the adaptive over-provisioning issue: where static APRIL
gains (small running batch on a small model) and where it loses (saturated or compute-bound).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clients.bench.server_api import BenchError

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


def _ratio(rec: dict[str, Any] | None) -> str:
    v = rec.get("output_throughput_vs_sync") if rec else None
    return "n/a" if v is None else f"x{v:.2f}"


def sweep_table(results: Sequence[tuple[SweepPoint, list[dict[str, Any]]]]) -> str:
    """One row per configuration: sync throughput, then each other mode's tok/s and ratio."""
    labels: list[str] = []
    for _, recs in results:
        for r in recs:
            if r["mode"] != "sync" and r["mode"] not in labels:
                labels.append(r["mode"])
    head = ["configuration", "sync tok/s"]
    for label in labels:
        head += [f"{label} tok/s", "x sync", "running target"] if "auto" in label else [
            f"{label} tok/s", "x sync"]  # fmt: skip
    head.append("checks")
    rows = [head]
    for point, recs in results:
        by_mode = {r["mode"]: r for r in recs}
        sync = by_mode.get("sync")
        row = [point.name, _tok(sync)]
        for label in labels:
            rec = by_mode.get(label)
            row += [_tok(rec), _ratio(rec)]
            if "auto" in label:
                targets = (rec or {}).get("inflight_targets") or []
                row.append("/".join(str(t) for t in targets) or "n/a")
        ok = all(r.get("checks_ok", True) for r in recs if r.get("available"))
        row.append("ok" if ok and recs else "FAIL")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _tok(rec: dict[str, Any] | None) -> str:
    v = rec.get("output_throughput") if rec else None
    return "n/a" if v is None else f"{v:.1f}"
