"""Agent rollouts for the TRL adapter: a tool executor answers each turn.

`AprilRollout(client, tool=lookup, turns={"stop_token_ids": [CALL], "max_turns": 3})` makes
each rollout call a streamed `/rollouts` call with `turns`: when a member's turn ends at a turn
stop, the server announces it (`sample_awaiting`), the adapter calls `tool(ToolCall)` with the
turn's text and ids and the group's dataset row, and posts the answer (`POST /samples/{id}/
input`); the member goes on in the same call. The tool returns its answer as text (tokenized
here with the trainer's tokenizer, no special tokens) or as token ids.

The rows TRL receives are the whole responses in context order, as TRL's own multi-turn tool
loop builds them: `completion_ids` = generated tokens with the tool answers at their positions
(`Sample.response_ids`), `logprobs` 0.0 on the answers, `env_mask` 0 exactly on the answers
(and on stale tokens with `stale_tokens="mask"`), so the loss skips what the tool wrote. The
server's budget (`max_completion_length`) counts generated tokens only: a row may be longer by
its answers. Answers are taken once per (sample, turn): a member announced again by a later
call (it was still awaiting when an earlier call ended) is not answered twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._routes import TurnsArg
from ._sync import AprilClient
from .protocol import Group, RolloutResp, Sample, SampleAwaitingEvent
from .trainer_batch import Rows, StaleTokens, fresh_mask, response_logprobs, response_mask


@dataclass(frozen=True)
class ToolCall:
    """What the tool sees of one ended turn."""

    text: str  # the turn's text (the trainer's tokenizer, special tokens kept)
    ids: list[int]  # the turn's token ids (the turn stop token included)
    turn: int  # 1 = the first
    metadata: Mapping[str, Any]  # the group's dataset row (its JSON-able columns)
    sample: Sample


Tool = Callable[[ToolCall], "str | Sequence[int]"]


def answer_ids(answer: str | Sequence[int], tokenizer: Any) -> list[int]:
    """The tool's answer as token ids: text through the tokenizer, ids as they are."""
    if isinstance(answer, str):
        ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    else:
        ids = [int(t) for t in answer]
    if not ids:
        raise ValueError("the tool answered nothing (an answer needs at least one token)")
    return ids


@dataclass
class ToolCalls:
    """Answers posted by the adapter: (sample_id, turn) once each."""

    answered: set[tuple[str, int]] = field(default_factory=set)
    posted_tokens: int = 0


def rollout_with_tool(
    client: AprilClient,
    specs: list[dict[str, Any]],
    target_groups: int,
    *,
    tool: Tool,
    tokenizer: Any,
    turns: TurnsArg,
    metadata: Mapping[str, Mapping[str, Any]],
    calls: ToolCalls,
    **kw: Any,
) -> RolloutResp:
    """One streamed `/rollouts` call whose awaiting members get the tool's answer at once;
    returns what `client.rollout` would (`kw`: its other arguments). `metadata`: each group's
    dataset row by group id (groups of earlier calls too: buffered ones come back)."""
    stream = client.rollout_stream(specs, target_groups, turns=turns, **kw)
    with stream:
        for ev in stream:
            if not isinstance(ev, SampleAwaitingEvent):
                continue
            key = (ev.sample.sample_id, ev.turn)
            if key in calls.answered:
                continue
            ids = ev.turn_ids
            call = ToolCall(
                text=tokenizer.decode(ids),
                ids=ids,
                turn=ev.turn,
                metadata=metadata.get(ev.sample.group_id, {}),
                sample=ev.sample,
            )
            answer = answer_ids(tool(call), tokenizer)
            client.post_input(ev.sample.sample_id, answer, turn=ev.turn)
            calls.answered.add(key)
            calls.posted_tokens += len(answer)
    done = stream.done
    if done is None:
        raise RuntimeError("the rollout stream ended without its done event")
    return RolloutResp(
        batch_id=done.batch_id,
        groups=stream.groups,
        buffered_group_ids=done.buffered_group_ids,
        stats=done.stats,
    )


def tool_rows(
    groups: Sequence[Group], n: int, current_version: str, stale: StaleTokens
) -> tuple[Rows, list[int]]:
    """Rows of whole responses (tool answers in place, `env_mask` 0 on them) and, per row,
    how many tool answers it holds."""
    rows, tool_calls = Rows(), []
    for group in groups:
        if len(group.samples) != n:
            raise ValueError(f"group {group.group_id} has {len(group.samples)} samples, not {n}")
        meta = group.metadata if isinstance(group.metadata, dict) else {}
        for sample in sorted(group.samples, key=lambda s: s.index):
            if sample.status not in ("completed", "truncated"):
                raise ValueError(f"sample {sample.sample_id} is unfinished ({sample.status})")
            fresh = fresh_mask(sample, current_version)
            rows.stale_tokens += len(fresh) - sum(fresh)
            rows.prompt_ids.append(list(sample.prompt_ids))
            rows.completion_ids.append(sample.response_ids)
            rows.logprobs.append(response_logprobs(sample))
            rows.env_mask.append(response_mask(sample, current_version, stale))
            rows.group_ids.append(group.group_id)
            rows.statuses.append(sample.status)
            rows.metadata.append(meta)
            tool_calls.append(len(sample.appended))
    return rows, tool_calls


@dataclass
class ToolLoop:
    """What `AprilRollout(tool=..., turns=...)` keeps: the tool, the turn rule, each group's
    dataset row by group id, and the answers posted so far."""

    tool: Tool
    turns: TurnsArg
    metadata: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    calls: ToolCalls = field(default_factory=ToolCalls)

    def __post_init__(self) -> None:
        if self.turns is None:
            raise ValueError(
                "a tool needs turns: what ends a turn, e.g. {'stop': ['</call>'], 'max_turns': 4}"
            )

    def rollout(
        self,
        client: AprilClient,
        specs: list[dict[str, Any]],
        target: int,
        tokenizer: Any,
        **kw: Any,
    ) -> RolloutResp:
        for s in specs:
            self.metadata[s["group_id"]] = s.get("metadata") or {}
        return rollout_with_tool(
            client,
            specs,
            target,
            tool=self.tool,
            tokenizer=tokenizer,
            turns=self.turns,
            metadata=self.metadata,
            calls=self.calls,
            **kw,
        )

    def rows(
        self, groups: Sequence[Group], n: int, version: str, stale: StaleTokens
    ) -> tuple[Rows, list[int]]:
        for g in groups:
            self.metadata.pop(g.group_id, None)  # consumed: it does not come back
        return tool_rows(groups, n, version, stale)
