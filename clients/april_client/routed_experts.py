"""Decode a sample's routed experts (`Sample.routing`, docs/api.md, Routing) for a trainer.

Needs numpy (the client itself does not): `experts(routing)` is the `[positions, num_layers,
top_k]` array of expert ids as recorded when each position was first computed; `recomputed(
routing)` the same positions as the newest re-prefill computed them (where one did) with the mask
of those positions; `versions(routing)` the weight version that computed each row.
"""

from __future__ import annotations

from typing import Any

from .protocol import Routing

MISSING = -1  # a position whose routing the engine never returned (`RoutingSpan.missing`)


def _decode(data: bytes, routing: Routing) -> Any:
    import numpy as np

    dtype = np.dtype("<u1" if routing.dtype == "uint8" else "<i2")
    rows = np.frombuffer(data, dtype=dtype).astype(np.int16)
    rows = rows.reshape(-1, routing.num_layers, routing.top_k)
    if routing.dtype == "uint8":
        rows[rows == 0xFF] = MISSING
    return rows


def experts(routing: Routing) -> Any:
    """int16 `[positions, num_layers, top_k]`: row p routed context token p; -1 where missing."""
    return _decode(routing.experts, routing)


def recomputed(routing: Routing) -> tuple[Any, Any]:
    """(`experts` with each recomputed position replaced by its newest recomputation, the bool
    `[positions]` mask of those positions)."""
    import numpy as np

    out = experts(routing).copy()
    mask = np.zeros(out.shape[0], dtype=bool)
    for part in routing.recomputed:
        out[part.start : part.end] = _decode(part.experts, routing)
        mask[part.start : part.end] = True
    return out, mask


def versions(routing: Routing) -> list[str]:
    """The weight version that computed each position's recorded row ("" where missing)."""
    out = [""] * routing.num_positions
    for span in routing.spans:
        out[span.start : span.end] = [span.weight_version] * (span.end - span.start)
    return out
