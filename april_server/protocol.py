"""Wire types of the april-server HTTP contract (docs/api.md), as msgspec Structs.

Imports only msgspec, so the client package can reuse these types with only httpx + msgspec.
Requests forbid unknown fields (a typo is a 4xx, not a silently ignored option); responses
allow them, so an older client keeps working against a newer server.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

SampleStatus = Literal["completed", "truncated", "partial"]
KvOrigin = Literal["fresh", "restored", "recomputed"]
OnQuota = Literal["snapshot", "tokens", "drop"]
KvMode = Literal["auto", "restore", "recompute"]


class _Req(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class _Resp(msgspec.Struct, omit_defaults=False):
    pass


# ---- objects ---------------------------------------------------------------------------------


class Segment(_Resp):
    """`output_ids[start:end]` came from `weight_version`; `kv` says how the segment began;
    `engine` and `dp_rank` say where it ran (placement; defaults for rows stored before)."""

    start: int
    end: int
    weight_version: str
    kv: KvOrigin
    finish_reason: str | None = None
    cached_tokens: int = 0
    engine: str = "local"
    dp_rank: int = 0


class Appended(_Resp):
    """Context tokens inserted by `/resume append_ids` after `output_ids[:at]` (not output)."""

    at: int
    ids: list[int]


class Sample(_Resp):
    sample_id: str
    group_id: str
    index: int
    status: SampleStatus
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    segments: list[Segment]
    max_new_tokens: int
    finish_reason: str | None
    sampling_params: dict[str, Any] = {}
    seed: int | None = None
    appended: list[Appended] = []
    metadata: Any = None
    snapshot_bytes: int = 0
    snapshot_weight_version: str | None = None
    # Where the KV snapshot lives (the slot of the segment it was taken from); null without one.
    snapshot_engine: str | None = None
    snapshot_dp_rank: int | None = None


class Group(_Resp):
    group_id: str
    samples: list[Sample]
    metadata: Any = None
    created_at: float = 0.0
    age_s: float = 0.0


# ---- requests --------------------------------------------------------------------------------


class GroupSpec(_Req):
    group_id: str
    n: int = 1
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = {}
    member_params: list[dict[str, Any]] | None = None
    seed: int | None = None
    metadata: Any = None


class RolloutReq(_Req):
    groups: list[GroupSpec] = []
    target_groups: int = 1
    resume_first: bool = True
    on_quota: OnQuota = "snapshot"
    max_staleness: int | None = None
    max_inflight_groups: int | Literal["auto"] = "auto"
    stream: bool = False
    request_id: str | None = None
    # Streamed calls only: after the quota is met, wait this long for late rejects.
    reject_grace_s: float = 0.0


class RejectReq(_Req):
    group_ids: list[str]


class AbortReq(_Req):
    batch_id: str | None = None
    group_ids: list[str] | None = None
    sample_ids: list[str] | None = None
    all: bool = False
    keep: OnQuota = "tokens"


class ResumeReq(_Req):
    sample_ids: list[str]
    append_ids: dict[str, list[int]] | None = None
    kv: KvMode = "auto"
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    # Stale KV reuse bound (versions), when the server allows it (--april-allow-stale-kv).
    max_staleness: int | None = None


# ---- responses -------------------------------------------------------------------------------


class RolloutStats(_Resp):
    wall_s: float
    weight_version: str
    num_finished_groups: int
    num_buffered_groups: int
    output_tokens: int
    offpolicy_tokens: int
    resumed_samples: int
    restored_kv_tokens: int
    recomputed_tokens: int
    quota_met: bool = True
    num_rejected_groups: int = 0
    num_dropped_groups: int = 0
    time_to_quota_s: float | None = None
    on_quota_effective: str = "tokens"
    # Running samples the adaptive policy aimed for (null when max_inflight_groups is pinned).
    inflight_target: int | None = None
    # Groups this call started generating (of those sent and resumed) and the most of its
    # samples generating at once: the in-flight policy at work, auditable per call.
    num_started_groups: int = 0
    peak_running_samples: int = 0
    # offpolicy_tokens / all output tokens of the returned groups.
    offpolicy_fraction: float = 0.0
    notes: list[str] = []


class RolloutResp(_Resp):
    batch_id: str
    groups: list[Group]
    buffered_group_ids: list[str]
    stats: RolloutStats
    # Groups this call discarded: rejected ones and, with on_quota=drop, started stragglers.
    dropped_group_ids: list[str] = []


class AbortResp(_Resp):
    samples: list[Sample]


class ResumeResp(_Resp):
    samples: list[Sample]


class PartialsResp(_Resp):
    groups: list[Group]
    # Where the next page starts (`?cursor=`); null on the last page. A page under a filter
    # may hold fewer than `limit` groups and still have a next one.
    next_cursor: str | None = None


class DeleteResp(_Resp):
    group_id: str
    deleted: bool


class ErrorDetail(_Resp):
    code: str
    message: str


class ErrorResp(_Resp):
    error: ErrorDetail


class GroupFinishedEvent(_Resp, tag_field="event", tag="group_finished"):
    group: Group
    batch_id: str = ""  # so a trainer can reject while the stream runs


class DoneEvent(_Resp, tag_field="event", tag="done"):
    batch_id: str
    buffered_group_ids: list[str]
    stats: RolloutStats


StreamEvent = GroupFinishedEvent | DoneEvent
