"""Routing replay across segments: pure rules over a sample's routed experts (no I/O, no torch).

A sample's `routing` holds one row per context position p (prompt, appended and output tokens in
context order) that has been fed to the model: the experts it was routed to in every MoE layer,
`[num_layers, top_k]`. Row p is recorded when p is first computed and never replaced:
- a segment restored from a KV snapshot recomputes none of its prefix, so the engine is asked
  only from the restore point (`SegmentCall.routing_start`, engine/base.py), and the rows
  before it are the recorded ones;
- a re-prefilled segment recomputes every position past its prefix-cache hit; the engine is
  asked from 0, the rows it recomputed (`cached_tokens` <= p < known) go to `recomputed`
  (the newest recomputation of each position, with its weight version), flagged per span;
- positions never fed before (the newest output token, appended tool tokens, new output) are
  appended, each span naming the segment and weight version that computed it.
Rows are fixed-size byte strings, so joining is slicing; the client decodes them to an array.
"""

from __future__ import annotations

from dataclasses import dataclass

from april_client.protocol import RecomputedRouting, Routing, RoutingDtype, RoutingSpan, Sample
from april_server.wire.errors import bad_request

FILL_BYTE = 0xFF  # every byte 0xff: 255 as uint8, -1 as int16 (a row the engine never returned)


@dataclass(frozen=True, slots=True)
class RoutingRows:
    """What an engine returned for one segment: rows for positions `start, start + 1, ...`."""

    start: int
    data: bytes  # [rows, num_layers, top_k] of `dtype`, little-endian
    num_layers: int
    top_k: int
    dtype: RoutingDtype

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.num_layers, self.top_k, self.dtype)


def row_bytes(num_layers: int, top_k: int, dtype: RoutingDtype) -> int:
    return num_layers * top_k * (1 if dtype == "uint8" else 2)


def dtype_for(num_experts: int) -> RoutingDtype:
    """The smallest dtype holding every expert id and the fill value (255 / -1)."""
    return "uint8" if num_experts < 0xFF else "int16"


def check_wanted(wanted: bool, available: object, where: str) -> None:
    """400 when routing is asked of an engine that returns none (`available`: its format)."""
    if wanted and available is None:
        raise bad_request(
            "routing_unavailable",
            f"{where}: return_routed_experts needs a mixture-of-experts model served with "
            "--enable-return-routed-experts",
        )


def record(
    sample: Sample,
    rows: RoutingRows | None,
    asked_from: int | None,
    fed: int,
    cached: int,
    weight_version: str,
    segment: int,
) -> None:
    """Record a segment's routing on `sample` (mutates it). `fed`: context positions fed to
    the model once the segment ended (context length - 1); `cached`: its prefix-cache hit."""
    if asked_from is None or not sample.return_routed_experts:
        return
    if rows is None:  # asked, and the engine returned none (no capture, waiting-queue abort)
        _extend_missing(sample, fed)
        return
    routing = sample.routing
    if routing is None or (routing.num_layers, routing.top_k, routing.dtype) != (
        rows.num_layers,
        rows.top_k,
        rows.dtype,
    ):
        routing = sample.routing = Routing(rows.num_layers, rows.top_k, rows.dtype, b"", [])
    rb = rows.row_bytes
    known = routing.num_positions
    start = rows.start
    end = min(start + len(rows.data) // rb, fed)
    lo, hi = max(start, cached), min(known, end)
    if lo < hi:  # positions computed before, computed again by this segment's prefill
        part = rows.data[(lo - start) * rb : (hi - start) * rb]
        _put_recomputed(routing, RecomputedRouting(lo, hi, weight_version, segment, part), rb)
    if start > known:  # a restored prefix whose rows were never recorded
        _extend_missing(sample, start)
    lo = max(routing.num_positions, start)
    if lo < end:
        routing.experts += rows.data[(lo - start) * rb : (end - start) * rb]
        _add_span(routing, RoutingSpan(lo, end, weight_version, segment))
    if end < fed:
        _extend_missing(sample, fed)


def _extend_missing(sample: Sample, upto: int) -> None:
    routing = sample.routing
    if routing is None:
        return  # nothing recorded yet: the first rows that come fix the shape
    known = routing.num_positions
    if known >= upto:
        return
    rb = row_bytes(routing.num_layers, routing.top_k, routing.dtype)
    routing.experts += bytes([FILL_BYTE]) * ((upto - known) * rb)
    _add_span(routing, RoutingSpan(known, upto, "", -1, missing=True))


def _add_span(routing: Routing, span: RoutingSpan) -> None:
    last = routing.spans[-1] if routing.spans else None
    if (
        last is not None
        and last.end == span.start
        and (last.weight_version, last.segment, last.missing)
        == (span.weight_version, span.segment, span.missing)
    ):
        last.end = span.end  # one request's prefill and decode rows are one span
        return
    routing.spans.append(span)


def _put_recomputed(routing: Routing, new: RecomputedRouting, rb: int) -> None:
    """Keep the newest recomputation of each position: older spans are cut around `new`."""
    kept: list[RecomputedRouting] = []
    for old in routing.recomputed:
        if old.end <= new.start or old.start >= new.end:
            kept.append(old)
            continue
        if old.start < new.start:
            cut = (new.start - old.start) * rb
            kept.append(
                RecomputedRouting(
                    old.start, new.start, old.weight_version, old.segment, old.experts[:cut]
                )
            )
        if old.end > new.end:
            cut = (new.end - old.start) * rb
            kept.append(
                RecomputedRouting(
                    new.end, old.end, old.weight_version, old.segment, old.experts[cut:]
                )
            )
    kept.append(new)
    kept.sort(key=lambda r: r.start)
    routing.recomputed = kept


def reset(sample: Sample) -> None:
    """Forget the routing (the output it described was thrown away); the setting stays."""
    sample.routing = None
