"""Figures gathered from every data-parallel rank, as one server shows them. Pure.

Counts, bytes and tokens add up (the server's snapshot budget is the sum of the ranks'
shares; its free KV pool is every rank's); rates (GB/s) are averaged over the ranks that
measured one. `/stats` shows the sums and, under `dp_ranks`, each rank's own figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def is_rate(key: str) -> bool:
    return "_gbps" in key


def merge_rank_stats(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum the numeric figures of `per_rank` (rates: mean of the non-zero ones); other values
    are taken from the first rank that has them."""
    out: dict[str, Any] = {}
    rates: dict[str, list[float]] = {}
    for figures in per_rank:
        for key, value in figures.items():
            if key == "dp_rank":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                out.setdefault(key, value)
            elif is_rate(key):
                rates.setdefault(key, [])
                if value:
                    rates[key].append(float(value))
            else:
                out[key] = out.get(key, 0) + value
    for key, values in rates.items():
        out[key] = round(sum(values) / len(values), 4) if values else 0.0
    return out
