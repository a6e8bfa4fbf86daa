"""Where a mode's distance to the bound goes (`bound.py`), from the engine's own clock.

Two views of one mode's rollout wall W, with R the bound (tokens per second), C the consumed
tokens and G the tokens the engine generated during the mode's calls:

- **wall by cause** (seconds): decode forwards at a full batch (the bound's knee: its batch
  bucket and above, `engine/clock.py` batch_bucket), decode forwards below it (the tail, or a
  pool too small to fill the engine), prefill of resumed work (re-prefill of continuations:
  the prefill time's share of recomputed tokens), prefill of new prompts, and outside forwards
  (scheduling, our bookkeeping, HTTP, the engine waiting for work).
- **the gap** (shares of R x W, the tokens a no-bubble engine would make in the same wall):
  `consumed` C / RW is the mode's fraction of the bound; the rest splits exactly into outside
  forwards (their wall share), prefill (its wall share), decode below the bound's rate
  ((R x decode s - G) / RW: the decode batch smaller than the bound's, or its steps slower; a
  prefill's first token counts as generated here), and generated but not consumed
  ((G - C) / RW: thrown away, or still in progress when the run ended; negative for
  april-async, whose calls consume tokens generated between them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from april_server.engine.clock import batch_bucket

_BUCKET_KEY = re.compile(r"^decode_(s|batches|tokens)_b(\d+)$")
_FIELD = {"s": 0, "batches": 1, "tokens": 2}


def decode_buckets(delta: Mapping[str, float]) -> dict[int, list[float]]:
    """The clock's decode-by-batch keys (`decode_s_b16`, ...) of a reading's delta: lower edge
    -> [seconds, steps, tokens], buckets without a step in the window left out."""
    out: dict[int, list[float]] = {}
    for key, value in delta.items():
        m = _BUCKET_KEY.match(key)
        if m:
            out.setdefault(int(m[2]), [0.0, 0.0, 0.0])[_FIELD[m[1]]] = float(value)
    return {edge: f for edge, f in sorted(out.items()) if f[1] > 0}


def wall_by_cause(tot: Mapping[str, Any], full_batch: int | None) -> dict[str, float] | None:
    """The rollout wall split by cause (module doc); None without the engine clock."""
    prefill, decode = tot.get("engine_prefill_s"), tot.get("engine_decode_s")
    if prefill is None or decode is None:
        return None
    wall = float(tot["rollout_wall_s"])
    edge = batch_bucket(full_batch) if full_batch else None
    buckets = tot.get("engine_decode_by_bucket") or {}
    full = sum(f[0] for e, f in buckets.items() if edge is not None and int(e) >= edge)
    full = min(full, decode)
    tokens = tot.get("engine_prefill_tokens") or 0
    resumed = min(1.0, (tot.get("recomputed_tokens") or 0) / tokens) if tokens else 0.0
    outside = wall - prefill - decode
    return {
        "full_batch_from": float(edge or 0),
        "decode_full_s": round(full, 4),
        "decode_tail_s": round(decode - full, 4),
        "prefill_resumed_s": round(prefill * resumed, 4),
        "prefill_new_s": round(prefill * (1 - resumed), 4),
        "outside_forwards_s": round(outside, 4),
        **_outside_split(tot, outside),
    }


def _outside_split(tot: Mapping[str, Any], outside: float) -> dict[str, float]:
    idle = tot.get("engine_idle_s")
    if idle is None:
        return {}
    idle = min(float(idle), max(outside, 0.0))
    return {"engine_idle_s": round(idle, 4), "scheduling_s": round(outside - idle, 4)}


def gap_to_bound(tot: Mapping[str, Any], bound_tok_s: float | None) -> dict[str, float] | None:
    """The shares of bound x wall (module doc): they sum to 1. None without a bound or the
    engine clock."""
    prefill, decode = tot.get("engine_prefill_s"), tot.get("engine_decode_s")
    wall = float(tot.get("rollout_wall_s") or 0.0)
    if not bound_tok_s or prefill is None or decode is None or wall <= 0:
        return None
    ideal = bound_tok_s * wall
    consumed = float(tot["consumed_tokens"])
    generated = float(tot.get("generated_in_calls", tot["generated_tokens"]))
    return {
        "consumed": round(consumed / ideal, 4),
        "outside_forwards": round((wall - prefill - decode) / wall, 4),
        "prefill": round(prefill / wall, 4),
        "decode_below_bound": round((bound_tok_s * decode - generated) / ideal, 4),
        "generated_not_consumed": round((generated - consumed) / ideal, 4),
    }


def shares_of_generated(tot: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(thrown away, still unconsumed at the end) as shares of the generated tokens."""
    generated = tot.get("generated_tokens") or 0
    if generated <= 0:
        return None, None
    return (
        round(tot.get("tokens_wasted", 0) / generated, 4),
        round(tot.get("leftover_tokens", 0) / generated, 4),
    )


def gap_line(mode: str, gap: Mapping[str, float]) -> str:
    return (
        f"{mode} vs the bound: consumed {gap['consumed']:.2f} of it; the gap: outside forwards "
        f"{gap['outside_forwards']:.2f}, prefill {gap['prefill']:.2f}, decode below the bound's "
        f"rate {gap['decode_below_bound']:.2f}, generated but not consumed "
        f"{gap['generated_not_consumed']:.2f}"
    )


def wall_line(mode: str, wall: float, causes: Mapping[str, float]) -> str:
    def part(name: str, key: str) -> str:
        s = causes[key]
        return f"{name} {s:.2f} ({100 * s / wall:.0f}%)" if wall > 0 else f"{name} {s:.2f}"

    edge = int(causes["full_batch_from"])
    return (
        f"{mode} wall by cause (s): "
        + ", ".join(
            [
                part(
                    f"decode at full batch (>= {edge})" if edge else "decode at full batch",
                    "decode_full_s",
                ),
                part("decode below it", "decode_tail_s"),
                part("prefill of resumed work", "prefill_resumed_s"),
                part("prefill of new prompts", "prefill_new_s"),
                part("outside forwards", "outside_forwards_s"),
            ]
        )
        + (
            f" [engine idle {causes['engine_idle_s']:.2f}, scheduling {causes['scheduling_s']:.2f}]"
            if "engine_idle_s" in causes
            else ""
        )
    )
