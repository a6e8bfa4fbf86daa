"""How many samples to keep generating at once (`max_inflight_groups: "auto"`). Pure Python.

The scheduler reports its decode step time per running-batch size (`StepCurve`, learned online
from SGLang's own steps). Throughput at batch b is b / t(b). Over-provisioning pays only while
a bigger batch still raises throughput (small models, memory-bound decode); once the engine is
saturated (t grows ~linearly with b), extra concurrency only adds stale tokens and re-prefill.
So the running target is the smallest batch reaching (1 - EPS) of the best throughput seen or
extrapolated, never less than what the quota itself needs (what a synchronous trainer runs),
never more than what was sent, never below a small floor (`MIN_RUNNING`); a cold server
starts at twice the quota and grows. Thinly measured sizes are credited with the doubt (`StepStat`),
so the policy goes and measures them rather than trusting a few noisy steps forever.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from statistics import median
from typing import NamedTuple

EPS = 0.05  # "raises throughput" means by more than 5 %
MIN_POINTS = 3  # below this many measured batch sizes, fall back to the prior
Z = 2.0  # optimism: a size is credited with its mean step time minus Z standard errors
# Never aim below this many running samples (when the call has them): on any engine a decode
# step of 8 costs about what a step of 1 does (per-step overhead; memory-bound on a GPU), so
# a measured curve that says otherwise at that size is noise, and serializing a small call
# on a nearly idle engine only makes it slow.
MIN_RUNNING = 8
COLD_OVERSAMPLING = 2  # a cold server runs twice the quota's demand, then grows from what
# it measured (it measures every size the batch passes through as it drains)


class StepStat(NamedTuple):
    """What the scheduler measured at one running-batch size."""

    steps: int  # decode steps measured at this size
    mean_s: float
    std_s: float
    mean_context: float = 0.0  # tokens attended per step (sum of sequence lengths)
    s_tc: float = 0.0  # centred co-sum of step time and context
    s_cc: float = 0.0  # centred sum of squares of context

    def optimistic(self) -> float:
        """A lower confidence bound on the step time. Large batches are measured only while
        the policy runs them, so a few slow steps there (CPU contention, the burst of a step's
        admissions) would otherwise keep it below them for good; crediting a thinly measured
        size with the doubt makes the policy try it, and trying it measures it (the bandit's
        optimism under uncertainty). Never below half the mean: one size's spread is no
        evidence that it is free."""
        if self.steps < 2:
            return self.mean_s
        return max(self.mean_s - Z * self.std_s / math.sqrt(self.steps), self.mean_s / 2)


@dataclass(frozen=True, slots=True)
class ContextModel:
    """t = f(b) + cost_per_token x context: attention reads every attended token (compute on
    CPU, KV bandwidth on a GPU), so one size's steps are cheaper early in a step, when contexts
    are short. Without this, a size measured mostly at short contexts (a warm-up, the start of
    every step) looks cheaper than its neighbours and pins the target there."""

    cost_per_token_s: float  # pooled within-size slope: the batch-size effect drops out
    context_per_sample: float  # what the steps attended per running sample, on average

    @classmethod
    def fit(cls, raw: Mapping[int, float | StepStat]) -> ContextModel | None:
        stats = {b: m for b, m in raw.items() if isinstance(m, StepStat) and m.mean_context > 0}
        s_cc = sum(m.s_cc for m in stats.values())
        steps_x_batch = sum(m.steps * b for b, m in stats.items())
        if s_cc <= 0 or steps_x_batch <= 0:
            return None
        slope = max(sum(m.s_tc for m in stats.values()) / s_cc, 0.0)
        per_sample = sum(m.steps * m.mean_context for m in stats.values()) / steps_x_batch
        return cls(slope, per_sample)

    def at_common_context(self, b: int, m: float | StepStat) -> float | StepStat:
        """The step time size `b` would have had at the common context per sample (a bare
        mean, or a size measured without context, is taken as it is)."""
        if not isinstance(m, StepStat) or m.mean_context <= 0:
            return m
        shift = self.cost_per_token_s * (b * self.context_per_sample - m.mean_context)
        return m._replace(
            mean_s=max(m.mean_s + shift, 1e-9), mean_context=b * self.context_per_sample
        )


@dataclass(frozen=True, slots=True)
class StepCurve:
    """Mean seconds per decode step, by running-batch size (measured sizes only)."""

    points: dict[int, float]
    context: ContextModel | None = None  # how `smoothed` evened out the measured contexts
    # The sorted sizes and the line past the largest, computed once: a policy decision asks
    # for every size up to twice the largest measured, and re-sorting the sizes and refitting
    # the line for each would be O(P^2) per size (seconds on the event loop at ~500 sizes).
    _sizes_memo: list[int] = field(default_factory=list, compare=False, repr=False)
    _line_memo: list[tuple[float, float]] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def smoothed(cls, raw: Mapping[int, float | StepStat]) -> StepCurve:
        """Isotonic (non-decreasing in batch size) fit by pool-adjacent-violators: a bigger
        batch never steps faster, so a dip is measurement noise (CPU contention, a prefill
        squeezed between two decode steps), not a cheaper batch. Measured sizes (`StepStat`)
        enter at a common context per sample (`ContextModel`) with their optimistic step time,
        weighted by how often they were measured."""
        model = ContextModel.fit(raw)
        blocks: list[list[float]] = []  # [weighted total, weight, first index]
        sizes = sorted(raw)
        for i, b in enumerate(sizes):
            m = raw[b] if model is None else model.at_common_context(b, raw[b])
            t, w = (m.optimistic(), float(m.steps)) if isinstance(m, StepStat) else (m, 1.0)
            blocks.append([t * w, w, float(i)])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                t, n, _ = blocks.pop()
                blocks[-1][0] += t
                blocks[-1][1] += n
        fitted: dict[int, float] = {}
        for j, (t, n, first) in enumerate(blocks):
            end = int(blocks[j + 1][2]) if j + 1 < len(blocks) else len(sizes)
            for b in sizes[int(first) : end]:
                fitted[b] = t / n
        return cls(fitted, model)

    def _sizes(self) -> list[int]:
        if not self._sizes_memo:
            self._sizes_memo.extend(sorted(self.points))
        return self._sizes_memo

    def step_time(self, b: int) -> float:
        if b in self.points:
            return self.points[b]
        sizes = self._sizes()
        i = bisect_left(sizes, b)  # sizes[i - 1] < b < sizes[i]
        lo = sizes[i - 1] if i > 0 else None
        hi = sizes[i] if i < len(sizes) else None
        if lo is not None and hi is not None:  # interpolate
            w = (b - lo) / (hi - lo)
            return self.points[lo] * (1 - w) + self.points[hi] * w
        if hi is None:
            return self._beyond(sizes, b)
        # Below the smallest measured size: the slope of the two smallest (never negative).
        if len(sizes) < 2:
            return self.points[sizes[0]]
        a, c = sizes[:2]
        slope = max((self.points[c] - self.points[a]) / (c - a), 0.0)
        return max(self.points[a] - slope * (a - b), 1e-9)

    def _beyond(self, sizes: list[int], b: int) -> float:
        """Past the largest measured size: a Theil-Sen line (median of pairwise slopes, never
        negative) over the upper half of the measured sizes. Not the last two points' slope:
        after isotonic pooling that is either 0 (one flat block) or whatever one noisy step
        makes it, and a steep one keeps the policy from ever exploring past what it measured.
        A median ignores a few slow outlier steps, which a least-squares line would not."""
        top = sizes[-1]
        if len(sizes) < 2:
            return self.points[top]
        if not self._line_memo:
            upper = [s for s in sizes if s >= top / 2]
            if len(upper) < 2:
                upper = sizes[-2:]
            pts = self.points
            pairs = combinations(upper, 2)
            slope = max(median((pts[j] - pts[i]) / (j - i) for i, j in pairs), 0.0)
            self._line_memo.append((median(pts[s] - slope * s for s in upper), slope))
        intercept, slope = self._line_memo[0]
        return max(intercept + slope * b, 1e-9)

    def throughput(self, b: int) -> float:
        return b / self.step_time(b)


def pool_steps(stats: Sequence[StepStat]) -> StepStat:
    """One batch size measured on several ranks, as if measured on one (means weighted by
    steps; the spreads and centred co-sums gain the between-rank terms)."""
    if len(stats) == 1:
        return stats[0]
    n = sum(m.steps for m in stats)
    if n <= 0:
        return stats[0]
    mt = sum(m.steps * m.mean_s for m in stats) / n
    mc = sum(m.steps * m.mean_context for m in stats) / n
    ss_t = sum((m.steps - 1) * m.std_s**2 + m.steps * (m.mean_s - mt) ** 2 for m in stats)
    s_tc = sum(m.s_tc + m.steps * (m.mean_s - mt) * (m.mean_context - mc) for m in stats)
    s_cc = sum(m.s_cc + m.steps * (m.mean_context - mc) ** 2 for m in stats)
    return StepStat(n, mt, math.sqrt(max(ss_t, 0.0) / max(n - 1, 1)), mc, s_tc, s_cc)


def aggregate_curve(per_rank: Sequence[Mapping[int, StepStat]]) -> dict[int, StepStat]:
    """The whole server's step curve from its data-parallel ranks' curves. The policy and
    admission reason about every sample the server runs; placement spreads them evenly (each
    new segment goes to the least loaded rank), and ranks step side by side, so n x b samples
    server-wide step in the time one rank takes for b. Each size is pooled over the ranks that
    measured it, then put at n x b, with n times the context (what all ranks attend)."""
    ranks = len(per_rank)
    if ranks <= 1:
        return dict(per_rank[0]) if per_rank else {}
    sizes = sorted({b for curve in per_rank for b in curve})
    out: dict[int, StepStat] = {}
    for b in sizes:
        m = pool_steps([curve[b] for curve in per_rank if b in curve])
        out[ranks * b] = m._replace(
            mean_context=ranks * m.mean_context, s_tc=ranks * m.s_tc, s_cc=ranks**2 * m.s_cc
        )
    return out


@dataclass(frozen=True, slots=True)
class InflightDecision:
    running_target: int  # samples to keep generating
    reason: str


def choose_running_target(curve: StepCurve, demand: int, cap: int) -> InflightDecision:
    """`demand`: samples the quota needs at once (target groups x group size);
    `cap`: samples the call could run at all (everything sent and buffered)."""
    demand = max(1, min(demand, cap))
    floor = min(cap, max(demand, MIN_RUNNING))
    if len(curve.points) < MIN_POINTS:
        cold = min(cap, max(COLD_OVERSAMPLING * demand, floor))
        return InflightDecision(
            cold,
            f"prior: too few measured batch sizes; {COLD_OVERSAMPLING}x the quota's {demand} "
            "(grows once sizes are measured)",
        )
    # Look up to twice the largest measured size, so a still-rising curve keeps exploring.
    horizon = min(cap, 2 * max(curve.points))
    if horizon <= floor:
        return InflightDecision(floor, "the quota alone fills every size worth considering")
    best = max(curve.throughput(b) for b in range(1, horizon + 1))
    knee = next(b for b in range(1, horizon + 1) if curve.throughput(b) >= (1 - EPS) * best)
    target = max(knee, floor)
    gain = curve.throughput(target) / curve.throughput(demand)
    return InflightDecision(
        target,
        f"knee at batch {knee} (x{gain:.2f} throughput over the quota's {demand}); "
        f"best {best:.1f} tok/s",
    )


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """What the engine can run at once (SGLang: its scheduler's limits; with data
    parallelism, the sum over its ranks: admission bounds the whole server, and placement
    keeps the ranks evenly loaded, so no rank is handed more than its share)."""

    max_running_requests: int
    max_total_tokens: int  # KV pool size in tokens


QUEUE_FRACTION = 0.25  # submitted beyond what can run: a short queue keeps the engine fed
QUEUE_MIN = 8
# KV a running sample will need: its context now plus this share of its budget left. SGLang's
# own scheduler admits requests with the same reserve at a cold start (init_new_token_ratio).
NEW_TOKEN_RESERVE = 0.7


def kv_need(context_tokens: int, remaining_tokens: int) -> float:
    return context_tokens + NEW_TOKEN_RESERVE * remaining_tokens


class Admission:
    """Bounds what is submitted to the engine at once by what it can run plus a short queue,
    so a call beside a huge buffer never floods the scheduler (its queue, its watchdog). One
    per server: every call's samples count. Unbounded until the engine's capacity is known."""

    def __init__(self) -> None:
        self.max_samples = 1 << 30
        self.max_tokens = float("inf")
        self.samples = 0
        self.tokens = 0.0

    def configure(self, capacity: EngineCapacity | None) -> None:
        if capacity is None:  # an engine that reports nothing: only the policy bounds it
            return
        run = max(1, capacity.max_running_requests)
        self.max_samples = run + max(QUEUE_MIN, int(run * QUEUE_FRACTION))
        self.max_tokens = capacity.max_total_tokens * (1 + QUEUE_FRACTION)

    def fits(self, samples: int, tokens: float) -> bool:
        """Whether `samples` more (needing `tokens` of KV) stay within the bound; a call that
        has nothing running starts its first group regardless (callers decide that)."""
        return (
            self.samples + samples <= self.max_samples and self.tokens + tokens <= self.max_tokens
        )

    def take(self, samples: int, tokens: float) -> None:
        self.samples += samples
        self.tokens += tokens

    def give_back(self, samples: int, tokens: float) -> None:
        self.samples -= samples
        # Float needs taken back in another order leave a residue: none when nothing runs.
        self.tokens = max(0.0, self.tokens - tokens) if self.samples else 0.0
