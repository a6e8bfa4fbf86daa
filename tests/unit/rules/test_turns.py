"""Turn rules (`rules/turns.py`), pure: what a turn spec may hold, the turn stops added to a
sample's own stops, and how a segment's end moves a member between turns (awaiting an answer,
the answer taken once, the episode ended by max_turns, EOS or its budget)."""

from __future__ import annotations

from typing import Any

import pytest

from april_client.protocol import Sample, TurnsSpec
from april_server.rules import turns
from april_server.rules.samples import SegmentResult, apply_segment
from april_server.wire.errors import ApiError


def sample_(**kw: Any) -> Sample:
    base: dict[str, Any] = dict(
        sample_id="g/0",
        group_id="g",
        index=0,
        status="partial",
        prompt_ids=[1],
        output_ids=[],
        output_logprobs=[],
        segments=[],
        max_new_tokens=10,
        finish_reason=None,
        turn_rule=turns.rule_of(TurnsSpec(stop=["</call>"], stop_token_ids=[7], max_turns=2)),
    )
    base.update(kw)
    return Sample(**base)


@pytest.mark.parametrize(
    "bad",
    [
        TurnsSpec(),
        TurnsSpec(stop=[""]),
        TurnsSpec(stop_token_ids=[-1]),
        TurnsSpec(stop_token_ids=[64]),
        TurnsSpec(stop_token_ids=[1], max_turns=0),
    ],
)
def test_bad_turn_rules_are_refused(bad: TurnsSpec) -> None:
    with pytest.raises(ApiError) as exc:
        turns.check_spec(bad, "g", 64)
    assert exc.value.code == "invalid_turns" and exc.value.status == 400


def test_turn_stops_are_added_to_the_samples_own() -> None:
    rule = turns.rule_of(TurnsSpec(stop=["</call>"], stop_token_ids=[7]))
    out = turns.with_turn_stops({"stop": "x", "stop_token_ids": [3]}, rule)
    assert out["stop"] == ["x", "</call>"] and out["stop_token_ids"] == [3, 7]


def test_a_turn_stop_makes_the_member_await_then_max_turns_ends_it() -> None:
    s = sample_()
    apply_segment(s, SegmentResult([4, 7], [0.0, 0.0], "stop", "1", matched=7), "fresh")
    turns.end_of_segment(s, 7, now=100.0)
    assert s.status == "awaiting_input" and s.turn == 1
    assert [(t.start, t.end, t.stop, t.end_reason) for t in s.turns] == [(0, 2, 7, "turn_stop")]
    with pytest.raises(ApiError) as exc:
        turns.check_answer(s, [], 64)
    assert exc.value.code == "invalid_request"
    turns.apply_answer(s, [11, 12], now=101.5)
    assert s.status == "partial" and s.turns[0].awaited_s == 1.5 and s.turn == 2
    with pytest.raises(ApiError) as exc:
        turns.check_answer(s, [1], 64)  # a second answer for the same turn
    assert exc.value.code == "not_awaiting" and exc.value.status == 409
    apply_segment(s, SegmentResult([5, 7], [0.0, 0.0], "stop", "2", matched="</call>"), "fresh")
    turns.end_of_segment(s, "</call>", now=102.0)
    assert s.status == "truncated"  # its second turn was its last (max_turns 2)
    assert s.turns[-1].end_reason == "max_turns" and s.turns[-1].weight_versions == ["2"]
    assert s.response_ids == [4, 7, 11, 12, 5, 7] and s.loss_mask == [1, 1, 0, 0, 1, 1]


def test_eos_and_budget_end_the_episode() -> None:
    s = sample_()
    apply_segment(s, SegmentResult([4, 2], [0.0, 0.0], "stop", "1", matched=2), "fresh")
    turns.end_of_segment(s, 2)
    assert s.status == "completed" and s.turns[-1].end_reason == "stop"
    s = sample_(max_new_tokens=2)
    apply_segment(s, SegmentResult([4, 7], [0.0, 0.0], "stop", "1", matched=7), "fresh")
    turns.end_of_segment(s, 7)
    assert s.status == "truncated" and s.turns[-1].end_reason == "length"
