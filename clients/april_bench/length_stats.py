"""What a workload's lengths look like, from the samples a mode consumed: the spread, the
share cut at the budget, and how strongly a group's (and a prompt's) samples agree — which is
what any length prediction can hope to use. Pure bookkeeping."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .accounting import Ledger


def shared_variance(by_key: Mapping[Any, Sequence[float]]) -> float | None:
    """The share of the variance of the values that lies between keys (1 - within / total):
    1 when every key's values are equal, about 0 when the key says nothing (None: too few)."""
    everything = [x for xs in by_key.values() for x in xs]
    if len(everything) < 3:
        return None
    total = float(np.var(everything))
    if total == 0:
        return None
    within = sum(float(np.var(xs)) * len(xs) for xs in by_key.values()) / len(everything)
    return round(1.0 - within / total, 3)


def length_figures(ledger: Ledger, max_tokens: int, prompts: int | None) -> dict[str, Any]:
    """Consumed samples' lengths: percentiles, share at the budget, and the share of the
    variance of log length explained by the group and, with `prompts` (group i asks prompt
    i % prompts), by the prompt."""
    consumed = [c for step in ledger.steps for c in step]
    if not consumed:
        return {}
    tokens = np.asarray([c.tokens for c in consumed], dtype=float)
    by_group: dict[str, list[float]] = {}
    by_prompt: dict[int, list[float]] = {}
    for c in consumed:
        x = math.log(max(c.tokens, 1))
        by_group.setdefault(c.group_id, []).append(x)
        if prompts:
            by_prompt.setdefault(ledger.sent[c.group_id] % prompts, []).append(x)
    p50, p90, p99 = (float(np.percentile(tokens, q)) for q in (50, 90, 99))
    return {
        "samples": len(consumed),
        "p50": round(p50, 1),
        "p90": round(p90, 1),
        "p99": round(p99, 1),
        "max": int(tokens.max()),
        "at_budget": round(float(np.mean(tokens >= max_tokens)), 3),
        "group_shared_variance": shared_variance(by_group),
        "prompt_shared_variance": shared_variance(by_prompt) if prompts else None,
    }


def score_delta(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> dict[str, Any]:
    """The length-prediction score of what ran between two `/stats` readings."""
    b = before or {}
    n = after["scored_samples"] - b.get("scored_samples", 0)
    sums = {
        k: after[k] - b.get(k, 0) for k in ("abs_error_tokens", "error_tokens", "abs_rel_error")
    }
    d = max(n, 1)
    return {
        "scored_samples": n,
        "mean_abs_error_tokens": round(sums["abs_error_tokens"] / d, 2),
        "mean_error_tokens": round(sums["error_tokens"] / d, 2),
        "mean_abs_rel_error": round(sums["abs_rel_error"] / d, 4),
    }


def lengths_line(mode: str, lf: Mapping[str, Any], pred: Mapping[str, Any] | None) -> str:
    text = (
        f"{mode} lengths (tokens): p50 {lf['p50']:.0f} p90 {lf['p90']:.0f} p99 {lf['p99']:.0f} "
        f"max {lf['max']}, {100 * lf['at_budget']:.0f}% at the budget; variance of log length "
        f"shared within a group {lf['group_shared_variance']}, within a prompt "
        f"{lf['prompt_shared_variance']}"
    )
    if pred and pred.get("scored_samples"):
        text += (
            f"; predicted vs actual over {pred['scored_samples']} samples: mean |error| "
            f"{pred['mean_abs_error_tokens']:.1f} tok ({100 * pred['mean_abs_rel_error']:.0f}%),"
            f" mean error {pred['mean_error_tokens']:+.1f}"
        )
    return text
