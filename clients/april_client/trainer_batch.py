"""Trainer-neutral rollout bookkeeping: what to send, what came back, which tokens are stale.

Pure functions over the wire types, shared by the trainer adapters (`trl.py`) and testable
without a trainer or a server. A trainer's step hands us `P` prompts for `P` groups of `n`; we
send them (plus extra prompts when over-provisioning), the server answers with exactly `P`
whole groups, and these helpers turn those groups into rows in contiguous group order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from .protocol import Group, RolloutResp, Sample

T = TypeVar("T")

StaleTokens = Literal["mask", "keep", "correct"]  # "correct": kept, see trl_correction.py


def extra_groups(target: int, over_provision: float, buffered: int, advised: int = 0) -> int:
    """How many extra prompts to send beside the step's own `target` groups.

    APRIL keeps `over_provision * target` groups in play per step, or `advised` if more (the
    server's `stats.groups_wanted` from the last call, when the trainer follows it). Groups
    already waiting in the buffer count toward it, so the buffer never grows past what is in
    play less `target` from this rule: every call sends `target + extra`, returns `target`, and
    buffers `extra` more.
    """
    if target < 1:
        raise ValueError(f"target must be >= 1, got {target}")
    if over_provision < 1.0:
        raise ValueError(f"over_provision must be >= 1.0, got {over_provision}")
    wanted = max(math.ceil(over_provision * target - 1e-9), advised)
    return max(0, wanted - target - buffered)


def background_level(target: int, over_provision: float, max_staleness: int | None) -> int:
    """How many groups to keep outstanding while the trainer trains (`background=True`).

    Outstanding groups generate in the background between calls; the next call returns the
    finished ones first, so what the engine runs while the trainer trains is what the next call
    finds ready. The level is bounded on both sides:

    - at least `target` (the next call's P groups): fewer and the next call must wait for
      generation it could have had during training (with `over_provision = 1`, nothing at all
      would run between calls);
    - at least `(over_provision - 1) * target`: what over-provisioning leaves anyway;
    - at most `max_staleness * target`: work done under the current weights must be returned
      by the next `max_staleness` calls, which return `target` groups each (finished ones
      first, oldest first). Beyond that a group finished in the background waits for a later
      call and is delivered older than `max_staleness` (a finished group is not restarted),
      or, unfinished, restarts from its prompt and its work is lost. With `max_staleness = 0`
      nothing may be generated ahead, so the level is 0; `None` sets no upper bound.
    """
    if target < 1:
        raise ValueError(f"target must be >= 1, got {target}")
    if over_provision < 1.0:
        raise ValueError(f"over_provision must be >= 1.0, got {over_provision}")
    level = max(target, math.ceil((over_provision - 1.0) * target - 1e-9))
    if max_staleness is not None:
        level = min(level, max_staleness * target)
    return level


def prefetch_groups(
    target: int, over_provision: float, outstanding: int, max_staleness: int | None
) -> int:
    """How many groups to hand in right after a training call, generating in the background.

    Tops the outstanding set (the call's stragglers, buffered or still generating) up to
    `background_level`. In steady state this is 0: each call sends its own `target` prompts
    and returns `target` groups, so the outstanding set keeps its size, and a bounded rule
    cannot hand in more than the calls take out. What the rule sets is that size: the first
    calls bring it to the level (with `over_provision = 1`, the call runs its own groups only
    and the prefetch hands in `target` more right after it: one step ahead), and after that
    the groups each call sends, but does not return, are the next training phase's work.
    """
    return max(0, background_level(target, over_provision, max_staleness) - outstanding)


def unique_prompts(prompts: Sequence[Any], n: int) -> list[Any]:
    """The step's prompts, one per group: the trainer repeats each `n` times, contiguously."""
    if n < 1 or len(prompts) % n:
        raise ValueError(f"{len(prompts)} prompts do not split into groups of {n}")
    firsts = [prompts[i] for i in range(0, len(prompts), n)]
    for g, first in enumerate(firsts):
        if any(p != first for p in prompts[g * n : (g + 1) * n]):
            raise ValueError(
                f"prompts {g * n}..{(g + 1) * n - 1} differ: expected each prompt repeated "
                f"{n} times contiguously (the trainer's RepeatSampler order)"
            )
    return firsts


def fresh_mask(sample: Sample, current_version: str) -> list[int]:
    """1 for each output token generated under `current_version`, 0 for older ones."""
    mask = [0] * len(sample.output_ids)
    for seg in sample.segments:
        if seg.weight_version == current_version:
            mask[seg.start : seg.end] = [1] * (seg.end - seg.start)
    return mask


def response_mask(
    sample: Sample, current_version: str | None = None, stale: StaleTokens = "keep"
) -> list[int]:
    """The loss mask over `sample.response_ids` (generated tokens with appended context, e.g.
    tool answers, in context order): 1 generated, 0 appended; with `stale="mask"`, also 0 for
    tokens generated under a weight version other than `current_version`."""
    keep = [1] * len(sample.output_ids)
    if stale == "mask":
        if current_version is None:
            raise ValueError("stale='mask' needs current_version")
        keep = fresh_mask(sample, current_version)
    return over_response(sample, keep, 0)


def over_response(sample: Sample, per_output: Sequence[T], fill: T) -> list[T]:
    """`per_output` (one value per `output_ids` token) laid over `sample.response_ids`: the
    appended context (tool answers) spliced in at its places, each of its tokens `fill`."""
    out: list[T] = []
    pos = 0
    for ap in sample.appended:
        out += list(per_output[pos : ap.at]) + [fill] * len(ap.ids)
        pos = ap.at
    return out + list(per_output[pos:])


def response_logprobs(sample: Sample) -> list[float]:
    """Per `response_ids` token: the sampling logprob, 0.0 on appended context (tool answers),
    as the trainers' own tool loops fill them."""
    return over_response(sample, sample.output_logprobs, 0.0)


def token_versions(sample: Sample) -> list[str | None]:
    """Per `response_ids` token: the weight version that sampled it, None on appended context."""
    generated: list[str | None] = [None] * len(sample.output_ids)
    for seg in sample.segments:
        generated[seg.start : seg.end] = [seg.weight_version] * (seg.end - seg.start)
    return over_response(sample, generated, None)


def call_record(sent: Sequence[str], resp: RolloutResp) -> dict[str, Any]:
    """What one quota call did, as the adapters log it: the groups it sent, those it returned,
    those of them an earlier call had sent (carried on the server), those left buffered, and
    the weight version it ended at."""
    new = set(sent)
    return {
        "sent": list(sent),
        "returned": [g.group_id for g in resp.groups],
        "carried": [g.group_id for g in resp.groups if g.group_id not in new],
        "buffered": list(resp.buffered_group_ids),
        "weight_version": resp.stats.weight_version,
    }


def jsonable(value: Any) -> Any:
    """A dataset row's value as JSON, to travel as a group's metadata (numpy arrays and scalars,
    as parquet gives them, become lists and numbers); TypeError for what JSON cannot hold."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"a row value of type {type(value).__name__} cannot travel as JSON")


def stale_tokens(sample: Sample, current_version: str) -> int:
    return len(sample.output_ids) - sum(fresh_mask(sample, current_version))


@dataclass
class Rows:
    """Rows for the trainer, `n` per group, groups in the order the server finished them."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    env_mask: list[list[int]] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)  # completed (EOS/stop) | truncated
    metadata: list[dict[str, Any]] = field(default_factory=list)
    stale_tokens: int = 0

    def columns(self) -> list[str]:
        """Metadata keys present in every row (what reward functions receive as kwargs)."""
        if not self.metadata:
            return []
        keys = set(self.metadata[0])
        for m in self.metadata[1:]:
            keys &= set(m)
        return sorted(keys)


def rows_from_groups(
    groups: Iterable[Group], n: int, current_version: str, stale: StaleTokens
) -> Rows:
    """Flatten whole groups into rows; `stale="mask"` zeroes tokens from older weights."""
    rows = Rows()
    for group in groups:
        if len(group.samples) != n:
            raise ValueError(f"group {group.group_id} has {len(group.samples)} samples, not {n}")
        meta = group.metadata if isinstance(group.metadata, dict) else {}
        for sample in sorted(group.samples, key=lambda s: s.index):
            if sample.status == "partial":
                raise ValueError(f"sample {sample.sample_id} is unfinished")
            fresh = fresh_mask(sample, current_version)
            rows.stale_tokens += len(fresh) - sum(fresh)
            rows.prompt_ids.append(list(sample.prompt_ids))
            rows.completion_ids.append(list(sample.output_ids))
            rows.logprobs.append(list(sample.output_logprobs))
            rows.env_mask.append(fresh if stale == "mask" else [1] * len(fresh))
            rows.group_ids.append(group.group_id)
            rows.statuses.append(sample.status)
            rows.metadata.append(meta)
    return rows


@dataclass
class Ledger:
    """Every group sent, returned and cleared, so a run can prove nothing was lost or doubled."""

    sent: dict[str, int] = field(default_factory=dict)  # group_id -> step it was sent at
    returned: dict[str, int] = field(default_factory=dict)  # group_id -> step it came back at
    cleared: set[str] = field(default_factory=set)  # left buffered at the end, then deleted

    def on_sent(self, group_ids: Iterable[str], step: int) -> None:
        for gid in group_ids:
            if gid in self.sent:
                raise ValueError(f"group {gid} sent twice")
            self.sent[gid] = step

    def on_returned(self, group_ids: Iterable[str], step: int) -> None:
        for gid in group_ids:
            if gid not in self.sent:
                raise ValueError(f"group {gid} came back but was never sent by this run")
            if gid in self.returned:
                raise ValueError(
                    f"group {gid} came back twice (steps {self.returned[gid]}, {step})"
                )
            self.returned[gid] = step

    def outstanding(self) -> list[str]:
        """Sent, not returned: buffered on the server (or lost, if it is not there)."""
        return [g for g in self.sent if g not in self.returned and g not in self.cleared]
