"""How many samples to keep generating at once (`max_inflight_groups: "auto"`). Pure Python.

The scheduler reports its decode step time per running-batch size (`StepCurve`, learned online
from SGLang's own steps). Throughput at batch b is b / t(b). Over-provisioning pays only while
a bigger batch still raises throughput (small models, memory-bound decode); once the engine is
saturated (t grows ~linearly with b), extra concurrency only adds stale tokens and re-prefill.
So the running target is the smallest batch reaching (1 - EPS) of the best throughput seen or
extrapolated, never less than what the quota itself needs (what a synchronous trainer runs),
never more than what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

EPS = 0.05  # "raises throughput" means by more than 5 %
MIN_POINTS = 3  # below this many measured batch sizes, fall back to the prior


@dataclass(frozen=True, slots=True)
class StepCurve:
    """Mean seconds per decode step, by running-batch size (measured sizes only)."""

    points: dict[int, float]

    @classmethod
    def smoothed(cls, raw: dict[int, float]) -> StepCurve:
        """Isotonic (non-decreasing in batch size) fit by pool-adjacent-violators: a bigger
        batch never steps faster, so a dip is measurement noise (CPU contention, a prefill
        squeezed between two decode steps), not a cheaper batch."""
        blocks: list[list[float]] = []  # [total, count, first index]
        sizes = sorted(raw)
        for i, b in enumerate(sizes):
            blocks.append([raw[b], 1.0, float(i)])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                t, n, _ = blocks.pop()
                blocks[-1][0] += t
                blocks[-1][1] += n
        fitted: dict[int, float] = {}
        for j, (t, n, first) in enumerate(blocks):
            end = int(blocks[j + 1][2]) if j + 1 < len(blocks) else len(sizes)
            for b in sizes[int(first) : end]:
                fitted[b] = t / n
        return cls(fitted)

    def step_time(self, b: int) -> float:
        sizes = sorted(self.points)
        if b in self.points:
            return self.points[b]
        lo = max((s for s in sizes if s < b), default=None)
        hi = min((s for s in sizes if s > b), default=None)
        if lo is not None and hi is not None:  # interpolate
            w = (b - lo) / (hi - lo)
            return self.points[lo] * (1 - w) + self.points[hi] * w
        # Extrapolate with the slope of the two nearest points (never a negative cost).
        pair = sizes[:2] if hi is not None else sizes[-2:]
        if len(pair) < 2:
            return self.points[pair[0]]
        a, c = pair
        slope = max((self.points[c] - self.points[a]) / (c - a), 0.0)
        edge = a if hi is not None else c
        return max(self.points[edge] + slope * (b - edge), 1e-9)

    def throughput(self, b: int) -> float:
        return b / self.step_time(b)


@dataclass(frozen=True, slots=True)
class InflightDecision:
    running_target: int  # samples to keep generating
    reason: str


def choose_running_target(curve: StepCurve, demand: int, cap: int) -> InflightDecision:
    """`demand`: samples the quota needs at once (target groups x group size);
    `cap`: samples the call could run at all (everything sent and buffered)."""
    demand = max(1, min(demand, cap))
    if len(curve.points) < MIN_POINTS:
        return InflightDecision(cap, "prior: too few measured batch sizes, run all (static APRIL)")
    # Look up to twice the largest measured size, so a still-rising curve keeps exploring.
    horizon = min(cap, 2 * max(curve.points))
    if horizon <= demand:
        return InflightDecision(demand, "the quota alone fills every size worth considering")
    best = max(curve.throughput(b) for b in range(1, horizon + 1))
    knee = next(b for b in range(1, horizon + 1) if curve.throughput(b) >= (1 - EPS) * best)
    target = max(knee, demand)
    gain = curve.throughput(target) / curve.throughput(demand)
    return InflightDecision(
        target,
        f"knee at batch {knee} (x{gain:.2f} throughput over the quota's {demand}); "
        f"best {best:.1f} tok/s",
    )
