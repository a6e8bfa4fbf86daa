"""Pure bookkeeping over samples and groups: build, plan a continuation, record a segment.

No I/O, no torch, no SGLang. Every rule of APRIL's resume semantics lives here:
- the budget of a continuation is what remains of the sample's total `max_new_tokens`;
- the context (prompt + appended + output) can never exceed the model's context length,
  because that is checked when the sample is created or tokens are appended;
- sampling params are the sample's own (member params merged at creation), seed `seed + index`;
- a sample whose newest segment is older than `max_staleness` versions restarts from its prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from april_client.protocol import (
    Appended,
    Group,
    GroupSpec,
    KvOrigin,
    Sample,
    Segment,
    TurnsSpec,
)
from april_server.rules import routing_replay as routing_rules
from april_server.rules import sampling_mask as mask_rules
from april_server.rules.turns import check_params as check_turn_params
from april_server.rules.turns import rule_of, with_turn_stops
from april_server.wire.errors import bad_request

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's own default, so an omitted budget means the same thing


@dataclass(frozen=True, slots=True)
class SegmentResult:
    """What one engine generation call produced (one segment of a sample)."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str | None  # "stop" | "length" | "abort" | None (engine error)
    weight_version: str
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    dp_rank: int | None = None  # the data-parallel rank that ran it, when the engine says
    matched: str | int | None = None  # the stop string or token id that ended it, if any
    # MoE routing replay: where the engine was asked for routed experts from (None: not
    # asked) and what it returned (None: nothing); rules/routing_replay.py records them.
    routing_asked: int | None = None
    routing: routing_rules.RoutingRows | None = None
    # Each generated token's kept set and sampling logprob, when asked and returned
    # (rules/sampling_mask.py records them).
    sampling_mask: mask_rules.MaskRows | None = None


@dataclass(frozen=True, slots=True)
class Continuation:
    """How to (re)start a sample on the engine."""

    input_ids: list[int]
    sampling_params: dict[str, Any]
    kv: KvOrigin
    restarted: bool  # True when staleness forced a restart from the prompt
    cache_ns: str | None = None  # the prefix-cache namespace of a stale restore (snapshots.py)


def sample_id_of(group_id: str, index: int) -> str:
    return f"{group_id}/{index}"


def is_finished(sample: Sample) -> bool:
    return sample.status in ("completed", "truncated")


def group_finished(group: Group) -> bool:
    return all(is_finished(s) for s in group.samples)


def remaining_budget(sample: Sample) -> int:
    return sample.max_new_tokens - len(sample.output_ids)


def context_ids(sample: Sample) -> list[int]:
    """prompt + output with appended turns interleaved at their recorded positions."""
    ids = list(sample.prompt_ids)
    pos = 0
    for ap in sample.appended:
        ids += sample.output_ids[pos : ap.at]
        ids += ap.ids
        pos = ap.at
    ids += sample.output_ids[pos:]
    return ids


def num_appended(sample: Sample) -> int:
    return sum(len(a.ids) for a in sample.appended)


def check_budget(
    prompt_len: int, extra_len: int, max_new_tokens: int, context_len: int, where: str
) -> None:
    """Raise 400 unless prompt + appended + the whole budget fits in the context."""
    if max_new_tokens < 0:
        raise bad_request("invalid_budget", f"{where}: max_new_tokens must be >= 0")
    total = prompt_len + extra_len + max_new_tokens
    if total > context_len:
        raise bad_request(
            "context_overflow",
            f"{where}: prompt ({prompt_len}) + appended ({extra_len}) + max_new_tokens "
            f"({max_new_tokens}) = {total} exceeds the context length {context_len}",
        )


def build_group(
    spec: GroupSpec,
    prompt_ids: list[int],
    context_len: int,
    vocab_size: int | None,
    turns: TurnsSpec | None = None,
    routing: bool = False,
    mask: bool = False,
) -> Group:
    """A new group from a request spec; raises 400 on bad input. `turns`: the call's turn
    rule, for a group that carries none; `routing`, `mask`: the call's `return_routed_experts`
    and `return_sampling_mask`, for a group that does not set its own."""
    gid = spec.group_id
    if not gid:
        raise bad_request("invalid_group", "group_id must be a non-empty string")
    if spec.n <= 0:
        raise bad_request("invalid_n", f"group {gid!r}: n must be >= 1, got {spec.n}")
    if not prompt_ids:
        raise bad_request("empty_prompt", f"group {gid!r}: the prompt is empty")
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in prompt_ids):
        raise bad_request(
            "invalid_token", f"group {gid!r}: token ids must lie in [0, {vocab_size})"
        )
    if spec.member_params is not None and len(spec.member_params) != spec.n:
        raise bad_request(
            "invalid_member_params",
            f"group {gid!r}: member_params has {len(spec.member_params)} entries, n is {spec.n}",
        )
    now = time.time()
    rule = rule_of(spec.turns if spec.turns is not None else turns)
    samples = []
    for i in range(spec.n):
        params = dict(spec.sampling_params)
        if spec.member_params is not None:
            params.update(spec.member_params[i])
        budget = params.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise bad_request("invalid_budget", f"group {gid!r}: max_new_tokens must be an int")
        check_budget(len(prompt_ids), 0, budget, context_len, f"group {gid!r} member {i}")
        check_turn_params(rule, params, f"group {gid!r} member {i}")
        samples.append(
            Sample(
                sample_id=sample_id_of(gid, i),
                group_id=gid,
                index=i,
                status="partial",
                prompt_ids=list(prompt_ids),
                output_ids=[],
                output_logprobs=[],
                segments=[],
                max_new_tokens=budget,
                finish_reason=None,
                sampling_params=params,
                seed=None if spec.seed is None else spec.seed + i,
                metadata=spec.metadata,
                turn_rule=rule,
                return_routed_experts=(
                    routing if spec.return_routed_experts is None else spec.return_routed_experts
                ),
                return_sampling_mask=(
                    mask if spec.return_sampling_mask is None else spec.return_sampling_mask
                ),
            )
        )
    return Group(group_id=gid, samples=samples, metadata=spec.metadata, created_at=now)


def version_lag(old: str, new: str, history: Sequence[str]) -> int:
    """How many weight versions `old` is behind `new` (ints compare numerically)."""
    if old == new:
        return 0
    try:
        return max(int(new) - int(old), 1)
    except ValueError:
        pass
    if old in history and new in history:
        return max(history.index(new) - history.index(old), 1)
    return 1


def plan_continuation(
    sample: Sample,
    weight_version: str,
    max_staleness: int | None,
    history: Sequence[str] = (),
    override_params: dict[str, Any] | None = None,
    by_oldest: bool = False,
) -> Continuation:
    """The engine input for the next segment of an unfinished sample. Mutates `sample` only
    when staleness forces a restart (its stale output is discarded, by the caller's policy).
    Staleness is the newest segment's lag; `by_oldest` (background samples, which would
    otherwise keep extending old work) judges by the oldest kept token's."""
    restarted = False
    if sample.segments and max_staleness is not None:
        judged = sample.segments[0 if by_oldest else -1]
        lag = version_lag(judged.weight_version, weight_version, history)
        if lag > max_staleness:
            restart_for_staleness(sample)
            restarted = True
    params = dict(sample.sampling_params)
    if override_params:
        params.update(override_params)
    params = with_turn_stops(params, sample.turn_rule)
    params["max_new_tokens"] = left = remaining_budget(sample)
    if params.get("min_new_tokens"):
        # The floor counts from the sample's start, as the budget does: a continuation owes
        # only what is left of it (sent whole, it exceeds a small remaining budget, which
        # SGLang refuses, and every later segment of the sample would fail the same way).
        owed = int(params["min_new_tokens"]) - len(sample.output_ids)
        params["min_new_tokens"] = max(0, min(owed, left))
    if sample.seed is not None:
        params["sampling_seed"] = sample.seed
    kv: KvOrigin = "recomputed" if (sample.output_ids or sample.appended) else "fresh"
    return Continuation(context_ids(sample), params, kv, restarted)


def reset_output(sample: Sample) -> None:
    """Forget everything generated (drop / staleness restart); the prompt stays."""
    sample.output_ids = []
    sample.output_logprobs = []
    sample.segments = []
    sample.appended = []
    sample.turns = []
    sample.status = "partial"
    sample.finish_reason = None
    routing_rules.reset(sample)
    mask_rules.reset(sample)
    clear_snapshot(sample)


def restart_for_staleness(sample: Sample) -> None:
    """Back to the prompt: its output is older than a `max_staleness` allows."""
    reset_output(sample)
    sample.staleness_restarts += 1


def clear_snapshot(sample: Sample) -> None:
    """Forget the sample's KV snapshot figures (it has none now)."""
    sample.snapshot_bytes = 0
    sample.snapshot_weight_version = None


def apply_segment(
    sample: Sample, result: SegmentResult, kv: KvOrigin, engine: str = "local", dp_rank: int = 0
) -> None:
    """Record one finished engine call on `sample` (mutates it); it ran on `engine`, rank
    `dp_rank`."""
    budget = remaining_budget(sample)
    new_ids = result.output_ids[:budget]
    new_lps = list(result.output_logprobs[: len(new_ids)])
    if len(new_lps) < len(new_ids):  # NOTE: never leave a token without its logprob slot
        new_lps += [float("nan")] * (len(new_ids) - len(new_lps))
    start = len(sample.output_ids)
    sample.output_ids += new_ids
    sample.output_logprobs += new_lps
    mask_rules.record(sample, result.sampling_mask, len(new_ids))
    recorded = bool(new_ids) or result.finish_reason in ("stop", "length")
    if recorded:
        sample.segments.append(
            Segment(
                start=start,
                end=len(sample.output_ids),
                weight_version=result.weight_version,
                kv=kv,
                finish_reason=result.finish_reason,
                cached_tokens=result.cached_tokens,
                engine=engine,
                dp_rank=dp_rank,
            )
        )
    # The rows this request computed belong to the segment it recorded (-1: it recorded none).
    segment = len(sample.segments) - 1 if recorded else -1
    fed = len(sample.prompt_ids) + num_appended(sample) + len(sample.output_ids) - 1
    routing_rules.record(
        sample,
        result.routing,
        result.routing_asked,
        fed,
        result.cached_tokens,
        result.weight_version,
        segment,
    )
    sample.finish_reason = result.finish_reason
    if result.finish_reason == "stop":
        sample.status = "completed"
    elif result.finish_reason == "length" or remaining_budget(sample) <= 0:
        sample.status = "truncated"
        sample.finish_reason = "length"
    else:
        sample.status = "partial"
        sample.finish_reason = None


def append_context(sample: Sample, ids: list[int], context_len: int) -> None:
    """Record tool/user tokens after the current output (not generated output)."""
    check_budget(
        len(sample.prompt_ids),
        num_appended(sample) + len(ids),
        sample.max_new_tokens,
        context_len,
        f"sample {sample.sample_id!r}",
    )
    sample.appended.append(Appended(at=len(sample.output_ids), ids=list(ids)))
    if sample.status == "completed" and remaining_budget(sample) > 0:
        sample.status = "partial"
        sample.finish_reason = None


def offpolicy_tokens(group: Group, weight_version: str) -> int:
    return sum(
        seg.end - seg.start
        for s in group.samples
        for seg in s.segments
        if seg.weight_version != weight_version
    )
