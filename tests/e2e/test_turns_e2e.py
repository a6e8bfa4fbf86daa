"""Agent rollouts on the real server (#20): a 3-turn episode of the embedded tiny model under
greedy decoding, whose turns end at a token it emits (found once: `STOP`), answered by a
deterministic tool. Interrupted mid-generation in turn 1, while awaiting the tool in turn 2,
and right after the tool's answer was posted, then resumed by a later call: each episode's
whole response (output with the appended answers, in context order) equals the uninterrupted
one, its loss mask marks exactly the appended tokens 0, and its turn records are the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from april_client import AprilClient, Conflict, NotFound
from april_client.protocol import (
    GroupFinishedEvent,
    Sample,
    SampleAwaitingEvent,
    SampleInterruptedEvent,
    StreamEvent,
)
from tests.e2e.test_rollouts_e2e import clear_buffer
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e

PROMPT = [31, 4, 5]
# Greedy on this prompt, the tiny model emits 364 after 12 tokens, and again after the first
# answer (turn 2: 39 tokens) and the second (turn 3, the last: max_turns).
STOP = 364
BUDGET = 90
TURNS = {"stop_token_ids": [STOP], "max_turns": 3}


def tool(turn: int) -> list[int]:
    return [100 + turn, 200 + turn, 300 + turn]


def agent(gid: str) -> dict[str, Any]:
    return {
        "group_id": gid,
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": BUDGET},
    }


def filler(gid: str) -> dict[str, Any]:
    """Finishes after one token: its group meets a quota of 1 at once."""
    return {"group_id": gid, "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}


@pytest.fixture()
def client(tiny_server: ServerProc) -> Any:
    with tiny_server.client() as http:
        clear_buffer(http)
    with AprilClient(tiny_server.url, timeout=300) as c:
        yield c
        c.abort(all=True)
    with tiny_server.client() as http:
        clear_buffer(http)


def run_call(
    c: AprilClient,
    groups: list[dict[str, Any]],
    on_awaiting: Callable[[SampleAwaitingEvent], bool] | None = None,
) -> list[StreamEvent]:
    """One streamed call (quota 1) whose awaiting members get the tool's answer at once,
    unless `on_awaiting` handled the event (returned True)."""
    events: list[StreamEvent] = []
    for ev in c.rollout_stream(groups, 1, turns=TURNS):
        events.append(ev)
        if isinstance(ev, SampleAwaitingEvent):
            if on_awaiting is not None and on_awaiting(ev):
                continue
            c.post_input(ev.sample.sample_id, tool(ev.turn))
    return events


def finished(events: list[StreamEvent], gid: str) -> Sample:
    for ev in events:
        if isinstance(ev, GroupFinishedEvent) and ev.group.group_id == gid:
            return ev.group.samples[0]
    raise AssertionError(f"{gid} did not finish: {[type(e).__name__ for e in events]}")


def resume(c: AprilClient, gid: str) -> Sample:
    """A later call (the buffer holds only `gid`) continues the episode to its end."""
    return finished(run_call(c, []), gid)


def turn_rows(s: Sample) -> list[tuple[int, int, Any, str]]:
    return [(t.start, t.end, t.stop, t.end_reason) for t in s.turns]


def assert_same_episode(got: Sample, want: Sample) -> None:
    assert got.response_ids == want.response_ids
    assert got.output_ids == want.output_ids
    assert turn_rows(got) == turn_rows(want)
    assert [(a.at, a.ids) for a in got.appended] == [(a.at, a.ids) for a in want.appended]
    zeros = [i for i, m in enumerate(got.loss_mask) if m == 0]
    appended_at = []
    pos = 0  # where each appended token lies in response_ids
    for a in got.appended:
        start = a.at + pos
        appended_at += range(start, start + len(a.ids))
        pos += len(a.ids)
    assert zeros == appended_at and len(zeros) == 6
    assert got.status == "truncated" and got.turns[-1].end_reason == "max_turns"
    assert all(t.awaited_s is not None and t.awaited_s >= 0 for t in got.turns[:-1])
    assert len(got.output_logprobs) == len(got.output_ids)


def uninterrupted(c: AprilClient) -> Sample:
    events = run_call(c, [agent("ep-ref")])
    s = finished(events, "ep-ref")
    assert turn_rows(s) == [
        (0, 12, STOP, "turn_stop"),
        (12, 51, STOP, "turn_stop"),
        (51, 80, STOP, "max_turns"),
    ], turn_rows(s)  # the premise: the model emits STOP there under greedy decoding
    awaited = [e for e in events if isinstance(e, SampleAwaitingEvent)]
    assert [e.turn for e in awaited] == [1, 2]
    assert all(e.text for e in awaited)  # the turn's text, for a tool that reads text
    return s


def test_interrupted_episodes_equal_the_uninterrupted_one(
    client: AprilClient, tiny_server: ServerProc
) -> None:
    c = client
    want = uninterrupted(c)

    # 1. Mid-generation in turn 1: a filler meets the quota after one token.
    for attempt in range(10):  # each attempt takes milliseconds
        gid = f"ep-mid-{attempt}"
        events = run_call(c, [agent(gid), filler(f"fill-{attempt}")])
        cut = [e for e in events if isinstance(e, SampleInterruptedEvent)]
        (s,) = c.partial(gid).samples
        if s.status == "partial" and not s.turns:  # the premise held: still in turn 1
            assert [(e.sample_id, e.turn, e.mid_turn) for e in cut] == [
                (f"{gid}/0", 1, bool(s.output_ids))
            ]
            break
        c.delete_partial(gid)  # the abort landed after turn 1 ended: try again
    else:
        pytest.fail("never interrupted inside turn 1")
    assert_same_episode(resume(c, gid), want)

    # 2. While awaiting the tool in turn 2: the call is aborted, the answer comes after it.
    gid = "ep-await"

    def stop_at_turn_2(ev: SampleAwaitingEvent) -> bool:
        if ev.turn < 2:
            return False
        c.abort(batch_id=ev.batch_id)  # the call ends; the member stays awaiting
        return True

    events = run_call(c, [agent(gid)], stop_at_turn_2)
    (s,) = c.partial(gid).samples
    assert s.status == "awaiting_input" and s.turn == 2
    assert c.partial(gid).state == "awaiting"
    assert c.stats()["awaiting_input_samples"] == 1
    with pytest.raises(NotFound):
        c.post_input("ep-nope/0", [1])
    answered = c.post_input(f"{gid}/0", tool(2))  # after its call ended: kept, idle
    assert answered.batch_id is None and answered.sample.status == "partial"
    with pytest.raises(Conflict) as exc:
        c.post_input(f"{gid}/0", tool(2))  # a second answer changes nothing
    assert exc.value.code == "not_awaiting"
    assert c.partial(gid).samples[0].appended == answered.sample.appended
    assert_same_episode(resume(c, gid), want)

    # 3. Right after the tool's answer was posted: the call is aborted at once.
    def answer_then_abort(ev: SampleAwaitingEvent) -> bool:
        r = c.post_input(ev.sample.sample_id, tool(ev.turn))
        assert r.batch_id == ev.batch_id  # it continues in its call...
        c.abort(batch_id=ev.batch_id)  # ...which is stopped right away
        return True

    for attempt in range(5):
        gid = f"ep-answered-{attempt}"
        run_call(c, [agent(gid)], answer_then_abort)
        (s,) = c.partial(gid).samples
        if len(s.turns) == 1:  # the premise held: the abort landed inside turn 2
            break
        c.delete_partial(gid)  # turn 2's 39 tokens ran before the abort arrived: again
    else:
        pytest.fail("never aborted inside turn 2")
    assert s.status == "partial" and s.turn == 2
    assert s.appended[0].ids == tool(1)
    assert_same_episode(resume(c, gid), want)
    with pytest.raises(NotFound):  # delivered: it left the server
        c.post_input(f"{gid}/0", [1])


def aborted_at(gid: str, at: int) -> dict[str, Any]:
    """`agent(gid)`, whose first segment the scheduler aborts in the step of its `at`-th
    token (door/fault_hooks.py: as an abort arriving during that step would)."""
    group = agent(gid)
    group["sampling_params"] = {
        **group["sampling_params"],
        "custom_params": {"april_abort_at_output_len": at},
    }
    return group


def test_a_turn_stop_generated_in_the_aborts_step_still_ends_the_turn(
    client: AprilClient, tiny_server: ServerProc
) -> None:
    """#36: SGLang says `abort` for the step that produced the turn stop; the member must
    await input all the same (stream event, /partials, /stats), for a stop token and for a
    stop string."""
    c = client
    want = uninterrupted(c)
    assert want.output_ids[11] == STOP  # the premise: the 12th token ends turn 1
    before = c.stats()["stops_behind_aborts"]

    # A stop token id, streamed: the call announces the member as awaiting, not interrupted.
    def abort_call(ev: SampleAwaitingEvent) -> bool:
        c.abort(batch_id=ev.batch_id)
        return True

    events = run_call(c, [aborted_at("ep-race", 12)], abort_call)
    awaited = [e for e in events if isinstance(e, SampleAwaitingEvent)]
    assert [(e.sample.sample_id, e.turn) for e in awaited] == [("ep-race/0", 1)]
    assert not [e for e in events if isinstance(e, SampleInterruptedEvent)]
    (s,) = c.partial("ep-race").samples
    assert s.status == "awaiting_input" and turn_rows(s) == [(0, 12, STOP, "turn_stop")]
    assert s.output_ids == want.output_ids[:12]
    assert c.stats()["awaiting_input_samples"] == 1
    assert c.stats()["stops_behind_aborts"] == before + 1
    c.delete_partial("ep-race")

    # A stop string whose text first appears with the 12th token, not streamed.
    with tiny_server.client() as http:
        texts = [
            http.post(
                "/generate",
                json={
                    "input_ids": PROMPT,
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": n},
                },
            ).json()["text"]
            for n in (11, 12)
        ]
    suffixes = [texts[1][-k:] for k in range(1, len(texts[1]) + 1)]
    stop = next(s for s in suffixes if s.strip() and s not in texts[0])
    c.rollout([aborted_at("ep-race-str", 12)], 1, turns={"stop": [stop], "max_turns": 3})
    (s,) = c.partial("ep-race-str").samples
    assert s.status == "awaiting_input", (stop, s.status, len(s.output_ids))
    assert turn_rows(s) == [(0, 12, stop, "turn_stop")]
    assert c.stats()["stops_behind_aborts"] == before + 2
