"""How old consumed tokens are: a histogram of consumed tokens by how many weight versions they
lag behind the version current when the trainer consumed them (0 = on-policy). Pure logic.

The bench knows the order of versions exactly (it pushed them), so a lag is counted in that
order; versions it did not push (another client's) fall back to integer order, as the server
does, and otherwise to `UNKNOWN`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

UNKNOWN = -1  # a lag the bench cannot tell (a version it never saw)


def version_lag(old: str, new: str, history: Sequence[str]) -> int:
    """How many versions `old` is behind `new`; `history` lists the versions in push order."""
    if old == new:
        return 0
    if new in history and old in history:
        i_new = len(history) - 1 - history[::-1].index(new)  # the latest push of `new`
        before = history[:i_new]
        if old in before:
            return i_new - (len(before) - 1 - before[::-1].index(old))
    try:
        lag = int(new) - int(old)
    except ValueError:
        return UNKNOWN
    return lag if lag >= 0 else UNKNOWN


def add(hist: dict[int, int], lag: int, tokens: int) -> None:
    if tokens:
        hist[lag] = hist.get(lag, 0) + tokens


def sample_histogram(
    samples: Iterable[Mapping[str, Any]], current: str, history: Sequence[str]
) -> dict[int, int]:
    """Consumed APRIL samples (their `segments`, each `[start, end)` under `weight_version`)."""
    hist: dict[int, int] = {}
    for s in samples:
        for seg in s["segments"]:
            lag = version_lag(str(seg["weight_version"]), current, history)
            add(hist, lag, int(seg["end"]) - int(seg["start"]))
    return hist


def merge(hists: Iterable[Mapping[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for h in hists:
        for lag, tokens in h.items():
            add(out, int(lag), tokens)
    return dict(sorted(out.items()))


def offpolicy_tokens(hist: Mapping[int, int]) -> int:
    """Tokens not generated under the consumption version (an unknown lag counts as off)."""
    return sum(t for lag, t in hist.items() if lag != 0)


def describe(hist: Mapping[int, int]) -> str:
    """`0: 812 (91.0%)  1: 80 (9.0%)`; an unknown lag prints as `?`."""
    total = sum(hist.values())
    if not total:
        return "no tokens"
    return "  ".join(
        f"{'?' if lag == UNKNOWN else lag}: {t} ({100 * t / total:.1f}%)"
        for lag, t in sorted(hist.items())
    )
