"""What the owner and an engine server say to each other (`/april/v1/engine/*`), as msgspec
types. A segment travels as `engine_base.SegmentCall` and comes back as `SegmentOutcome`
(dataclasses, which msgspec encodes and decodes as they are)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from april_client.protocol import RoutingDtype
from april_server.engine.base import SegmentCall, SegmentOutcome

ENGINE_PREFIX = "/april/v1/engine"


class EngineInfo(msgspec.Struct, frozen=True):
    """An engine server's identity and state (`GET /april/v1/engine/info`)."""

    context_len: int
    vocab_size: int | None
    dp_size: int
    weight_version: str
    assigns_seeds: bool
    snapshots_enabled: bool
    model_path: str = ""
    has_tokenizer: bool = True
    eos_token_ids: list[int] = []  # what ends generation unless ignore_eos (stops.py)
    tp_size: int = 1  # its ranks in a trainer's weight-update group
    weight_group: str | None = None  # the weight-update group it is in (a restart: none)
    # (layers, top_k, dtype) of the routed experts it returns (MoE capture); null: none.
    routing_format: tuple[int, int, RoutingDtype] | None = None
    # The most ids a sampling-mask row may hold (--sampling-mask-max-tokens); null: no masks.
    sampling_mask_tokens: int | None = None


class ControlOp(msgspec.Struct, frozen=True):
    """`mark` (snapshot `rid` under `key` if it ends by abort) or `abort`."""

    op: Literal["mark", "abort"]
    rid: str
    key: str = ""
    dp_rank: int = 0


class ControlReq(msgspec.Struct, frozen=True):
    """Ops performed in order: a mark sent before an abort is in place before it."""

    ops: list[ControlOp]


class KvReq(msgspec.Struct, frozen=True):
    op: Literal["drop", "info", "restore", "release", "keys"]  # keys: every rank's
    key: str
    dp_rank: int = 0
    namespace: str | None = None  # restore: the prefix-cache namespace (`snapshots.py`)


class KvResp(msgspec.Struct, frozen=True):
    restored: int = 0
    info: dict[str, Any] | None = None


encoder = msgspec.json.Encoder()
segment_call = msgspec.json.Decoder(SegmentCall)
segment_outcome = msgspec.json.Decoder(SegmentOutcome)
engine_info = msgspec.json.Decoder(EngineInfo)
control_req = msgspec.json.Decoder(ControlReq)
kv_req = msgspec.json.Decoder(KvReq)
kv_resp = msgspec.json.Decoder(KvResp)
