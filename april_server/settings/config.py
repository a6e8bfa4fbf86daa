"""april-server's own settings (the `--april-*` flags); SGLang's stay in its ServerArgs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from april_server.settings.env import DEFAULT_KV_HOST_BYTES

# The orders a call may start its new groups in (rules/lengths.py orders them).
LengthOrder = Literal["arrival", "longest_first", "shortest_first"]
LENGTH_ORDERS: tuple[LengthOrder, ...] = get_args(LengthOrder)
# Where a segment runs when its snapshot does not decide (rules/placement.py).
Placement = Literal["least_loaded", "tail"]
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)


@dataclass(frozen=True, slots=True)
class AprilConfig:
    # Durable partial buffer lives here (SQLite). None: in memory only, lost on exit.
    state_dir: Path | None = None
    # Host bytes for KV snapshots (LRU beyond it; 0 disables snapshots).
    kv_host_bytes: int = DEFAULT_KV_HOST_BYTES
    # Reuse a KV snapshot from an older weight version when the sample's max_staleness allows.
    allow_stale_kv: bool = False
    # Seconds between sweeps that free snapshots nobody refers to (`snapshot_sweep.py`); 0:
    # never; None: the mode's default (an owner sweeps every 10 s, one server never).
    snapshot_sweep_s: float | None = None
    # The order a call starts its new groups in when it names none (`length_order`):
    # arrival | longest_first | shortest_first (predicted lengths, rules/lengths.py).
    length_order: LengthOrder = "arrival"
    # least_loaded | tail (predicted-long samples together on one engine of an owner).
    placement: Placement = "least_loaded"

    # Request limits: each violation is a clear 4xx, never work started.
    max_groups_per_call: int = 4096
    max_n: int = 1024
    # Samples (the sum of n) in one call: each is an object held in memory and a row in the
    # buffer, so 4096 groups x 1024 would be 4M from a body of a few MiB.
    max_samples_per_call: int = 65536

    def __post_init__(self) -> None:
        if self.kv_host_bytes < 0:
            raise ValueError("kv_host_bytes must be >= 0")
        if self.max_groups_per_call < 1:
            raise ValueError("max_groups_per_call must be >= 1")
        if self.snapshot_sweep_s is not None and self.snapshot_sweep_s < 0:
            raise ValueError("snapshot_sweep_s must be >= 0")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if self.max_samples_per_call < 1:
            raise ValueError("max_samples_per_call must be >= 1")
        if self.length_order not in LENGTH_ORDERS:
            raise ValueError(f"length_order must be one of {', '.join(LENGTH_ORDERS)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")

    @property
    def buffer_path(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / "buffer.sqlite"
