"""Wire types of the april-server HTTP contract (docs/api.md), as msgspec Structs.

Imports only msgspec, so the client package can reuse these types with only httpx + msgspec.
Requests forbid unknown fields (a typo is a 4xx, not a silently ignored option); responses
allow them, so an older client keeps working against a newer server.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# `awaiting_input`: its turn ended at a turn stop; it waits for the tool's answer (Turns).
SampleStatus = Literal["completed", "truncated", "partial", "awaiting_input"]
# What ended a turn: a turn stop (the member then awaits input), or its episode's end.
TurnEnd = Literal["turn_stop", "stop", "length", "max_turns"]
KvOrigin = Literal["fresh", "restored", "recomputed"]
# What becomes of an interrupted sample (abort `keep`, and stopping a call's stragglers).
Keep = Literal["snapshot", "tokens", "drop"]
# What a call does with its stragglers: interrupt them (a `Keep`), or let them go on generating
# in the background after it answered (`continue`).
OnQuota = Literal["snapshot", "tokens", "drop", "continue"]
KvMode = Literal["auto", "restore", "recompute"]
RoutingDtype = Literal["uint8", "int16"]  # of routed expert ids (docs/api.md, Routing)
MaskDtype = Literal["uint16", "int32"]  # of sampling-mask token ids (docs/api.md, Sampling mask)


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


class RoutingSpan(_Resp):
    """Rows `[start, end)` of a sample's `routing` (context positions) and where they came
    from: the engine request of `segments[segment]` (-1: a request that generated no token,
    e.g. one stopped in its prefill) under `weight_version`. `missing`: the engine returned
    no routing for them (their rows hold the dtype's fill value, -1 / 255)."""

    start: int
    end: int
    weight_version: str
    segment: int
    missing: bool = False


class RecomputedRouting(_Resp):
    """Routing of positions `[start, end)` as a re-prefill computed them again (under
    `weight_version`, for `segments[segment]`), beside the rows recorded when they were first
    computed. Encoded as `Routing.experts`; the newest recomputation of a position is kept."""

    start: int
    end: int
    weight_version: str
    segment: int
    experts: bytes


class Routing(_Resp):
    """The experts a mixture-of-experts model routed each context position to (docs/api.md,
    Routing): `experts` is `[positions, num_layers, top_k]` of `dtype` (little-endian,
    row-major; base64 in JSON), row p for context token p as the model's input. The last
    context token has no row until a later segment feeds it. `april_client.routed_experts`
    decodes it."""

    num_layers: int
    top_k: int
    dtype: RoutingDtype
    experts: bytes
    spans: list[RoutingSpan]
    recomputed: list[RecomputedRouting] = []

    @property
    def num_positions(self) -> int:
        row = self.num_layers * self.top_k * (1 if self.dtype == "uint8" else 2)
        return len(self.experts) // row if row else 0


class SamplingMask(_Resp):
    """What the sampler kept of the vocabulary for each generated token (docs/api.md, Sampling
    mask): row i belongs to `output_ids[i]`. `ids`: every row's kept token ids, row after row,
    ascending within a row, `dtype` little-endian (base64 in JSON); `counts`: how many ids each
    row holds, in `dtype` too (0: a token whose mask the engine was not asked for, or did not
    return); `logprobs[i]`: the logprob of `output_ids[i]` over its row, renormalised (0.0 for a
    greedy token, alone in its row; 0.0 and meaningless where the count is 0). Decode with
    `april_client.sampling_mask`."""

    dtype: MaskDtype
    ids: bytes
    counts: bytes
    logprobs: list[float]

    @property
    def num_rows(self) -> int:
        return len(self.logprobs)


class Appended(_Resp):
    """Context tokens inserted by `/resume append_ids` after `output_ids[:at]` (not output)."""

    at: int
    ids: list[int]


class TurnRule(_Resp):
    """What ends a turn of a member (as sent in a request's `turns`, kept on the sample)."""

    stop: list[str] = []
    stop_token_ids: list[int] = []
    max_turns: int | None = None


class Turn(_Resp):
    """One finished turn: `output_ids[start:end]`, what ended it (`end_reason`; `stop` is the
    matched stop string or token id, when one matched), the weight versions that generated it,
    when it ended (Unix seconds) and how long the sample then waited for input (null while it
    waits, and after the episode's last turn)."""

    start: int
    end: int
    stop: str | int | None
    end_reason: TurnEnd = "turn_stop"
    awaited_s: float | None = None
    weight_versions: list[str] = []
    ended_at: float = 0.0


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
    # Agent rollouts (docs/api.md, Turns): the member's turn rule and its finished turns.
    turn_rule: TurnRule | None = None
    turns: list[Turn] = []
    # Times its output was thrown away to restart from the prompt for `max_staleness`: a
    # sample too long to finish within the bound restarts at every push (docs/trainers.md).
    staleness_restarts: int = 0
    # Length prediction (docs/api.md, Length prediction): the final output length predicted
    # when its last segment started, from finished siblings and the prompt's earlier rollouts
    # (null without evidence); what is left of it (0 once it finished); how much to trust it.
    predicted_tokens: int | None = None
    predicted_remaining: int | None = None
    prediction_confidence: float | None = None
    # Mixture-of-experts routing replay (docs/api.md, Routing): asked for by the call or the
    # group, kept across segments; null when not asked for.
    return_routed_experts: bool = False
    routing: Routing | None = None
    # The kept set and the sampling logprob of every generated token (docs/api.md, Sampling
    # mask): asked for by the call, the group or /resume, kept across segments; null when off.
    return_sampling_mask: bool = False
    sampling_mask: SamplingMask | None = None

    @property
    def turn(self) -> int:
        """The turn the sample is in (1 = the first): awaiting input, the turn that just
        ended; otherwise the one generating or to generate next."""
        done = len(self.turns)
        ended = self.status in ("completed", "truncated") and done > 0
        return done if self.status == "awaiting_input" or ended else done + 1

    @property
    def response_ids(self) -> list[int]:
        """The whole response in context order: generated tokens with the appended context
        (tool answers, user turns) at their positions."""
        out: list[int] = []
        pos = 0
        for ap in self.appended:
            out += self.output_ids[pos : ap.at]
            out += ap.ids
            pos = ap.at
        out += self.output_ids[pos:]
        return out

    @property
    def loss_mask(self) -> list[int]:
        """One entry per `response_ids` token: 1 generated, 0 appended (stale tokens: see
        `april_client.trainer_batch.response_mask`)."""
        out: list[int] = []
        pos = 0
        for ap in self.appended:
            out += [1] * (ap.at - pos) + [0] * len(ap.ids)
            pos = ap.at
        out += [1] * (len(self.output_ids) - pos)
        return out


class Group(_Resp):
    group_id: str
    samples: list[Sample]
    metadata: Any = None
    created_at: float = 0.0
    age_s: float = 0.0
    # In /partials: idle | running (generating in the background) | finished (whole, waiting to
    # be delivered). Not stored; null where it does not apply.
    state: str | None = None


# ---- requests --------------------------------------------------------------------------------


class TurnsSpec(_Req):
    """`turns` of a group or a call: stop strings and stop token ids that end a turn (the
    member then awaits input), and the most turns an episode may have."""

    stop: list[str] = []
    stop_token_ids: list[int] = []
    max_turns: int | None = None


class GroupSpec(_Req):
    group_id: str
    n: int = 1
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = {}
    member_params: list[dict[str, Any]] | None = None
    seed: int | None = None
    metadata: Any = None
    # What ends a turn of its members (agent rollouts); overrides the call's `turns`.
    turns: TurnsSpec | None = None
    # Return the routed experts of every position (MoE; docs/api.md, Routing); null: the call's.
    return_routed_experts: bool | None = None
    # Return every generated token's sampling mask (docs/api.md, Sampling mask); null: the call's.
    return_sampling_mask: bool | None = None


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
    # What ends a turn, for every group that does not carry its own (agent rollouts).
    turns: TurnsSpec | None = None
    # The order the call starts its new groups in (docs/api.md, Length prediction): as sent,
    # or by predicted length; null takes the server's --april-length-order.
    length_order: Literal["arrival", "longest_first", "shortest_first"] | None = None
    # Every new group's samples carry their routed experts (MoE; docs/api.md, Routing).
    return_routed_experts: bool = False
    # Every new group's samples carry their sampling masks (docs/api.md, Sampling mask).
    return_sampling_mask: bool = False


class GroupsReq(_Req):
    """`POST /groups`: hand groups in without waiting (prefetch)."""

    groups: list[GroupSpec]
    start: Literal["background", "idle"] = "background"
    max_staleness: int | None = None
    request_id: str | None = None
    turns: TurnsSpec | None = None
    return_routed_experts: bool = False
    return_sampling_mask: bool = False


class RejectReq(_Req):
    group_ids: list[str]


class AbortReq(_Req):
    batch_id: str | None = None
    group_ids: list[str] | None = None
    sample_ids: list[str] | None = None
    all: bool = False
    keep: Keep = "tokens"


class ResumeReq(_Req):
    sample_ids: list[str]
    append_ids: dict[str, list[int]] | None = None
    kv: KvMode = "auto"
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    # Stale KV reuse bound (versions), when the server allows it (--april-allow-stale-kv).
    max_staleness: int | None = None
    # Turn routing replay on (or off) for these samples from now on; null keeps their setting.
    return_routed_experts: bool | None = None
    # Turn sampling masks on (or off: the record is dropped) for these samples from now on;
    # null keeps their setting.
    return_sampling_mask: bool | None = None


class InputReq(_Req):
    """`POST /samples/{sample_id}/input`: the tool's answer, as token ids or text."""

    append_ids: list[int] | None = None
    text: str | None = None
    # The turn it answers (the `turn` of its `sample_awaiting` event): a retry that arrives
    # after the member moved on to a later turn gets 409 instead of answering that one.
    turn: int | None = None


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
    # Groups the next call should hold, carried and new (max_inflight_groups "auto" only):
    # enough to keep the running batch at the engine's best size until the quota is met,
    # played forward from the predicted lengths. Advice; null without evidence.
    groups_wanted: int | None = None
    # offpolicy_tokens / all output tokens of the returned groups.
    offpolicy_fraction: float = 0.0
    notes: list[str] = []
    # max_inflight_groups "auto": the groups it kept in progress beyond what its quota still
    # needed (the pool that maximises tokens within max_staleness per second), the goodput
    # its play expected at that pool and a synchronous trainer's; before any length evidence,
    # 0 under max_staleness (no play: the expected figures null), else null. What it got: its
    # returned tokens within max_staleness per second of it.
    extra_groups: int | None = None
    goodput_expected_tok_s: float | None = None
    goodput_sync_tok_s: float | None = None
    goodput_tok_s: float | None = None


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


class InputResp(_Resp):
    sample: Sample
    batch_id: str | None  # the running call that continues it now (null: it waits idle)


class PartialsResp(_Resp):
    groups: list[Group]
    # Where the next page starts (`?cursor=`); null on the last page. A page under a filter
    # may hold fewer than `limit` groups and still have a next one.
    next_cursor: str | None = None


class GroupsResp(_Resp):
    group_ids: list[str]
    started_samples: int  # handed to the background (they start once no call runs)


class DeleteResp(_Resp):
    group_id: str
    deleted: bool


class LengthsForgotten(_Resp):
    """`DELETE /april/v1/lengths`: how many prompts' length histories were forgotten."""

    forgotten_prompts: int


class WeightGroupInfo(_Resp):
    """`GET /april/v1/weights/group`: what a trainer needs to push weights over a torch
    distributed group (docs/api.md, "Weights over the wire"). The trainer is rank 0; the
    server's engines take `ranks` ranks after it, so a new group's world size is 1 + `ranks`."""

    ranks: int  # the ranks this server's engines (every engine of an owner's that is up) take
    weight_version: str
    group: str | None = None  # the weight-update group they are in (the last one initialised)
    world_size: int | None = None
    in_sync: bool = True  # every engine that is up is in `group`: a push reaches them all
    behind: list[str] = []  # engines outside it (restarted, joined later): held out of serving


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


class SampleAwaitingEvent(_Resp, tag_field="event", tag="sample_awaiting"):
    """A member's turn `turn` ended at a turn stop: run the tool, post its answer."""

    sample: Sample
    turn: int
    batch_id: str = ""
    text: str | None = None  # the turn's text, when the server has a tokenizer

    @property
    def turn_ids(self) -> list[int]:
        """The token ids of the turn that just ended."""
        t = self.sample.turns[-1] if self.sample.turns else None
        return [] if t is None else self.sample.output_ids[t.start : t.end]


class SampleInterruptedEvent(_Resp, tag_field="event", tag="sample_interrupted"):
    """The call winds down (quota met, abort) and stopped this generating member; `mid_turn`:
    it had generated part of turn `turn` (kept, resumable)."""

    sample_id: str
    turn: int
    mid_turn: bool
    batch_id: str = ""


StreamEvent = GroupFinishedEvent | SampleAwaitingEvent | SampleInterruptedEvent | DoneEvent
