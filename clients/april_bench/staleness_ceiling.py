"""The most a trainer's staleness bound lets the engine deliver: a ceiling beside the bound.

The bound (`bound.py`) never waits for a straggler. A trainer that pushes weights after every
step and takes no token more than s versions old waits in a weaker way: every sample it
consumes was generated within s + 1 consecutive steps. No schedule knows a sample's length
before it ends (the server never reads a budget as a promise), so the Q samples started in a
step are as long as any Q samples, and the longest of them (M, its mean E[M]) must fit in the
s + 1 steps from its start: summed over a run, the steps last at least E[M] / (s + 1) decode
steps each on average. That holds for schedules that start about as many samples each step as
they consume, as every pool the server sizes does; uneven starts can shorten the steps a
little (the expected longest of n samples grows ever more slowly with n: at s = 1 on the
8 x 4 long tail, starts of 16, 16 and 64 over three steps need 7 % fewer decode steps, by
linear programming), so this is a ceiling for even starts. A step consumes the
trainer's Q samples, Q x E[L] tokens, so a long step is a small batch. With the engine's time
per decode step at each batch taken from the bound's own levels (`StepCost`; their
scheduling, prefill of new prompts and HTTP inside, as in the bound), a step of
I >= E[M] / (s + 1) decode steps making G tokens takes at least I x t(G / I), and

    consumed tokens per second <= Q x E[L] / (I x t(Q x E[L] / I))

never above the bound. Throwing away the longest samples shortens M: every cut D whose thrown
share (D x P(L > D) of every sample started, against what is kept) is at most `thrown_max` is
weighed, the best kept. A carried sample's re-prefill after a push is not counted, so this is
a ceiling, not a forecast. At s = 0 it is the synchronous trainer's own loop (the step lasts as
long as its longest sample), which it matches within the fit's error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .workload import Workload

THROWN_MAX = 0.05  # the share of generated tokens a fresh schedule may throw away
LENGTH_GROUPS = 4096  # groups of the workload drawn for its lengths


@dataclass(frozen=True)
class StepCost:
    """Wall seconds per decode step by running batch: the lower convex hull of the bound's
    levels (batch, batch / tok/s), linear between its corners and beyond its ends. Convex, so
    a step's decode steps cost no less at a constant batch than at any mix of the same mean
    (a lower bound on the time, as a ceiling needs), and below every measured level."""

    batches: tuple[float, ...]
    step_s: tuple[float, ...]

    @classmethod
    def fit(cls, levels: Sequence[Mapping[str, Any]]) -> StepCost | None:
        """None with fewer than two levels that measured a batch."""
        points = sorted(
            (float(lv["mean_batch"]), float(lv["mean_batch"]) / float(lv["tok_s"]))
            for lv in levels
            if lv.get("mean_batch") and lv.get("tok_s")
        )
        hull: list[tuple[float, float]] = []
        for p in points:
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            if hull and hull[-1][0] == p[0]:
                continue  # the same batch twice: the lower (first, sorted) stays
            hull.append(p)
        if len(hull) < 2:
            return None
        return cls(tuple(b for b, _ in hull), tuple(w for _, w in hull))

    def at(self, batch: float) -> float:
        """Seconds per decode step at `batch`: the hull's segment over it, extended past the
        ends (never below zero)."""
        i = int(np.searchsorted(self.batches, batch))
        i = min(max(i, 1), len(self.batches) - 1)
        (b0, b1), (w0, w1) = self.batches[i - 1 : i + 1], self.step_s[i - 1 : i + 1]
        return max(0.0, w0 + (w1 - w0) * (batch - b0) / (b1 - b0))


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    """> 0 when o -> a -> b turns left (a lies below the chord o-b: a corner of the hull)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


@dataclass(frozen=True)
class StalenessCeiling:
    tok_s: float  # consumed tokens per second, at most
    share_of_bound: float
    max_staleness: int
    step_decodes: float  # decode steps per trainer step, at least
    longest_mean: float  # E[M]: the mean longest of a step's Q samples (cut at `cut`)
    mean_batch: float
    cut: int  # D: a sample longer than this is thrown away (the longest length: none is)
    thrown_share: float  # of generated tokens

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def staleness_ceiling(
    levels: Sequence[Mapping[str, Any]],
    lengths: Sequence[int],
    quota_samples: int,
    max_staleness: int,
    thrown_max: float = THROWN_MAX,
) -> StalenessCeiling | None:
    """The module's ceiling from the bound's levels (`Bound.to_json()["bound_levels"]`) and
    sample lengths in the workload's order (a step's samples are consecutive ones). None
    without a usable bound, or with fewer lengths than one step's."""
    cost = StepCost.fit(levels)
    steps = len(lengths) // quota_samples if quota_samples > 0 else 0
    if cost is None or steps < 1 or max_staleness < 0:
        return None
    # The best of the levels the cost was fitted from (a window without a decode batch has
    # no batch to run at).
    best_batch = max(cost.batches, key=lambda b: b / cost.at(b))
    bound_tok_s, max_batch = best_batch / cost.at(best_batch), best_batch
    all_lengths = np.asarray(lengths, dtype=np.float64)
    by_step = all_lengths[: steps * quota_samples].reshape(steps, quota_samples)
    top: StalenessCeiling | None = None
    for cut in np.unique(all_lengths):
        kept_mask = all_lengths <= cut
        kept_share = float(kept_mask.mean())
        kept = float(all_lengths[kept_mask].sum()) / len(all_lengths)  # E[L; L <= D]
        thrown = float(cut) * (1.0 - kept_share)  # D x P(L > D)
        thrown_share = thrown / (kept + thrown)
        if thrown_share > thrown_max:
            continue
        starts = quota_samples / kept_share  # started per step to consume the quota
        consumed, generated = starts * kept, starts * (kept + thrown)
        longest = float(np.minimum(by_step, cut).max(axis=1).mean())
        decodes = max(longest / (max_staleness + 1), generated / max_batch)
        time_s = decodes * cost.at(generated / decodes)
        tok_s = min(bound_tok_s, consumed / time_s) if time_s > 0 else bound_tok_s
        if top is None or tok_s > top.tok_s:
            top = StalenessCeiling(
                tok_s=tok_s,
                share_of_bound=tok_s / bound_tok_s,
                max_staleness=max_staleness,
                step_decodes=decodes,
                longest_mean=longest,
                mean_batch=generated / decodes,
                cut=int(cut),
                thrown_share=thrown_share,
            )
    return top


def for_run(
    levels: Sequence[Mapping[str, Any]] | None,
    wl: Workload,
    quota_samples: int,
    max_staleness: int | None,
    pushes: bool,
) -> StalenessCeiling | None:
    """The ceiling of a run whose trainer pushes after every step under a `max_staleness`, for
    workloads whose lengths are known before they run (long-tail and JSONL budgets); None
    otherwise (no push, no bound on staleness: the bound itself is the ceiling; lengths the
    model decides are not known ahead)."""
    if not levels or not pushes or max_staleness is None or wl.kind not in ("longtail", "jsonl"):
        return None
    lengths = [b for g in wl.groups(0, LENGTH_GROUPS) for b in g.budgets]
    return staleness_ceiling(levels, lengths, quota_samples, max_staleness)


def ceiling_line(b: Mapping[str, Any]) -> str:
    thrown = (
        "none thrown away"
        if b["thrown_share"] == 0
        else f"samples longer than {b['cut']} thrown away, {b['thrown_share']:.1%} of generated"
    )
    return (
        f"staleness ceiling (a push every step, every consumed token within max_staleness "
        f"{b['max_staleness']}, lengths unknown until they end): {b['tok_s']:.0f} tok/s, "
        f"{b['share_of_bound']:.2f} of the bound (a step's longest sample averages "
        f"{b['longest_mean']:.0f} tokens, so steps of >= {b['step_decodes']:.0f} decode steps at "
        f"a batch of {b['mean_batch']:.1f}; {thrown})"
    )
