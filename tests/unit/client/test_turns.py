"""The typed client's agent-rollout surface (`client.py`, `trainer_batch.py`): `post_input`,
`turns` on calls, the turn events of a stream, and the loss mask over the whole response
(httpx.MockTransport)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from april_client import AprilClient, Conflict
from april_client.protocol import (
    Appended,
    DoneEvent,
    InputResp,
    Sample,
    SampleAwaitingEvent,
    SampleInterruptedEvent,
    Segment,
)
from april_client.trainer_batch import response_mask
from tests.unit.client.client_fakes import DONE_LINE, SAMPLE, SPEC, URL, both, both_raise, recorder

AWAITING = {
    **SAMPLE,
    "status": "awaiting_input",
    "output_ids": [4, 7],
    "output_logprobs": [0.0, 0.0],
    "turns": [{"start": 0, "end": 2, "stop": 7, "end_reason": "turn_stop", "awaited_s": None}],
}


def test_post_input_sends_the_answer_and_reads_the_sample() -> None:
    seen, handler = recorder(body={"sample": AWAITING, "batch_id": "b-1"})
    for r in both(handler, lambda c: c.post_input("g/0", [5, 6])):
        assert isinstance(r, InputResp) and r.batch_id == "b-1"
        assert r.sample.status == "awaiting_input" and r.sample.turns[0].stop == 7
    both(handler, lambda c: c.post_input("g/0", text="42", turn=2))
    assert [(q.method, q.url.path) for q in seen] == [("POST", "/april/v1/samples/g/0/input")] * 4
    assert [json.loads(q.content) for q in seen] == [{"append_ids": [5, 6]}] * 2 + [
        {"text": "42", "turn": 2}
    ] * 2


def test_post_input_needs_exactly_one_answer_and_maps_409() -> None:
    with AprilClient(URL, transport=httpx.MockTransport(lambda r: httpx.Response(200))) as c:
        with pytest.raises(ValueError):
            c.post_input("g/0")
        with pytest.raises(ValueError):
            c.post_input("g/0", [1], text="x")
    body = {"error": {"code": "not_awaiting", "message": "sample 'g/0' is partial"}}
    _, handler = recorder(409, body)
    for err in both_raise(handler, lambda c: c.post_input("g/0", [1])):
        assert isinstance(err, Conflict) and err.code == "not_awaiting"


def test_turns_travel_with_a_call() -> None:
    seen, handler = recorder(content=DONE_LINE)
    turns = {"stop_token_ids": [7], "max_turns": 3}
    with AprilClient(URL, transport=httpx.MockTransport(handler)) as c:
        list(c.rollout_stream([SPEC], 1, turns=turns))
        with pytest.raises(ValueError):
            c.rollout_stream([SPEC], 1, turns={"max_turns": "x"})
    assert json.loads(seen[0].content)["turns"] == turns


def test_stream_yields_typed_turn_events() -> None:
    lines = [
        {"event": "sample_awaiting", "sample": AWAITING, "turn": 1, "batch_id": "b"},
        {"event": "sample_interrupted", "sample_id": "g/1", "turn": 2, "mid_turn": True},
    ]
    body = b"".join(json.dumps(x).encode() + b"\n" for x in lines) + DONE_LINE

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    with AprilClient(URL, transport=httpx.MockTransport(handler)) as c:
        s = c.rollout_stream([SPEC], 1)
        events = list(s)
    assert [type(e) for e in events] == [SampleAwaitingEvent, SampleInterruptedEvent, DoneEvent]
    first = events[0]
    assert isinstance(first, SampleAwaitingEvent) and first.turn_ids == [4, 7]
    assert s.groups == []  # turn events are not groups


def sample(**kw: Any) -> Sample:
    base: dict[str, Any] = dict(SAMPLE)
    base.update(kw)
    return Sample(**base)


def test_loss_mask_marks_appended_tokens_and_optionally_stale_ones() -> None:
    s = sample(
        output_ids=[1, 2, 3, 4],
        output_logprobs=[0.0] * 4,
        appended=[Appended(at=2, ids=[8, 9, 10])],
        segments=[
            Segment(start=0, end=2, weight_version="1", kv="fresh"),
            Segment(start=2, end=4, weight_version="2", kv="recomputed"),
        ],
    )
    assert s.response_ids == [1, 2, 8, 9, 10, 3, 4]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1, 1] == response_mask(s)
    assert response_mask(s, "2", "mask") == [0, 0, 0, 0, 0, 1, 1]
