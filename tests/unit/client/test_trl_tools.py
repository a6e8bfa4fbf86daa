"""The TRL adapter's tool loop (#20 item 5): each awaiting turn gets the tool's answer once,
with the group's dataset row; rows hold the whole response with env_mask 0 exactly on the
tool's tokens and logprobs aligned (httpx.MockTransport, no server, no TRL)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from april_client import AprilClient
from april_client.protocol import Appended, Group, Sample, Segment
from april_client.trl_tools import ToolCall, ToolLoop, answer_ids, response_logprobs, tool_rows
from tests.unit.client.client_fakes import DONE_LINE, SAMPLE, URL

CALL = 7


class Tok:
    """A stand-in tokenizer: one id per character (ord), decode joins them back."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def seg(end: int) -> Segment:
    return Segment(start=0, end=end, weight_version="0", kv="fresh")


def awaiting(sid: str, gid: str, turn_ids: list[int], turn: int) -> dict[str, Any]:
    s = {
        **SAMPLE,
        "sample_id": sid,
        "group_id": gid,
        "status": "awaiting_input",
        "output_ids": turn_ids,
        "output_logprobs": [-0.5] * len(turn_ids),
        "turns": [{"start": 0, "end": len(turn_ids), "stop": CALL}],
    }
    return {"event": "sample_awaiting", "sample": s, "turn": turn, "batch_id": "b"}


def test_each_awaiting_turn_gets_the_tool_answer_once_with_its_groups_row() -> None:
    events = [
        awaiting("g/0", "g", [65, CALL], 1),
        awaiting("h/1", "h", [66, CALL], 1),
        awaiting("g/0", "g", [65, CALL], 1),
    ]  # announced again: no 2nd post
    body = b"".join(json.dumps(e).encode() + b"\n" for e in events) + DONE_LINE
    posted: list[tuple[str, Any]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path.endswith("/rollouts"):
            sent = json.loads(req.content)
            assert sent["turns"] == {"stop_token_ids": [CALL], "max_turns": 2}
            assert sent["stream"] is True and sent["request_id"] == "r1"
            return httpx.Response(200, content=body)
        posted.append((req.url.path, json.loads(req.content)))
        sid = req.url.path.split("/samples/")[1].removesuffix("/input")
        sample = {**SAMPLE, "sample_id": sid}
        return httpx.Response(200, json={"sample": sample, "batch_id": "b"})

    seen: list[ToolCall] = []

    def tool(call: ToolCall) -> str | list[int]:
        seen.append(call)
        return f"={call.metadata['secret']}" if call.sample.group_id == "g" else [90, 91]

    loop = ToolLoop(tool, {"stop_token_ids": [CALL], "max_turns": 2})
    loop.metadata["h"] = {"secret": "h-row"}  # a group buffered by an earlier call
    specs = [{"group_id": "g", "input_ids": [1], "metadata": {"secret": "4"}}]
    with AprilClient(URL, transport=httpx.MockTransport(handler)) as c:
        resp = loop.rollout(c, specs, 1, Tok(), request_id="r1")
    assert resp.batch_id == "b" and resp.groups == []
    assert [(c.text, c.ids, c.turn, dict(c.metadata)) for c in seen] == [
        ("A\x07", [65, CALL], 1, {"secret": "4"}),
        ("B\x07", [66, CALL], 1, {"secret": "h-row"}),
    ]
    assert posted == [
        ("/april/v1/samples/g/0/input", {"append_ids": [ord("="), ord("4")], "turn": 1}),
        ("/april/v1/samples/h/1/input", {"append_ids": [90, 91], "turn": 1}),
    ]
    assert loop.calls.answered == {("g/0", 1), ("h/1", 1)} and loop.calls.posted_tokens == 4


def test_a_tool_needs_turns_and_an_answer() -> None:
    with pytest.raises(ValueError):
        ToolLoop(lambda c: "x", None)
    with pytest.raises(ValueError):
        answer_ids("", Tok())
    assert answer_ids((5, 6), Tok()) == [5, 6]


def test_rows_hold_the_whole_response_with_only_the_tool_tokens_masked() -> None:
    s0 = Sample(
        **{
            **SAMPLE,
            "status": "truncated",
            "output_ids": [10, 11, CALL, 12, 13],
            "output_logprobs": [-1.0, -2.0, -3.0, -4.0, -5.0],
            "appended": [Appended(at=3, ids=[80, 81])],
            "segments": [seg(5)],
        }
    )
    s1 = Sample(
        **{
            **SAMPLE,
            "sample_id": "g/1",
            "index": 1,
            "status": "completed",
            "output_ids": [20],
            "output_logprobs": [-0.5],
            "segments": [seg(1)],
        }
    )
    group = Group(group_id="g", samples=[s1, s0], metadata={"secret": "4"})
    rows, calls = tool_rows([group], 2, "0", "keep")
    assert rows.completion_ids == [[10, 11, CALL, 80, 81, 12, 13], [20]]
    assert rows.env_mask == [[1, 1, 1, 0, 0, 1, 1], [1]]
    assert rows.logprobs == [[-1.0, -2.0, -3.0, 0.0, 0.0, -4.0, -5.0], [-0.5]]
    assert calls == [1, 0] and rows.metadata == [{"secret": "4"}] * 2
    assert response_logprobs(s0) == rows.logprobs[0]
    # Stale tokens masked too with "mask" (generated under another version).
    rows, _ = tool_rows([group], 2, "1", "mask")
    assert rows.env_mask == [[0] * 7, [0]] and rows.stale_tokens == 6
    awaiting_sample = Sample(**{**SAMPLE, "status": "awaiting_input"})
    with pytest.raises(ValueError):
        tool_rows([Group(group_id="g", samples=[awaiting_sample])], 1, "0", "keep")
