"""Agent rollouts (#20): turn rules (`turns.py`), and calls that stop members at turn stops,
take answers during and after the call (`inputs.py`), and wind down turn-safely. Fake engine:
its tokens are a hash of the context, so `episode()` below is an independent oracle."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from april_client.protocol import (
    AbortReq,
    GroupSpec,
    InputReq,
    RolloutReq,
    Sample,
    SampleAwaitingEvent,
    SampleInterruptedEvent,
    StreamEvent,
    TurnsSpec,
)
from april_server.buffer.store import BufferStore
from april_server.root.manager import RolloutManager
from april_server.rules import turns
from april_server.rules.samples import SegmentResult, apply_segment
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import EOS, FakeEngine, next_token

PROMPT = [5, 6, 7]
STOPS = [9, 17, 33, 41]  # turn stop token ids
BUDGET = 60
TURNS = TurnsSpec(stop_token_ids=STOPS, max_turns=3)


def answer(turn: int) -> list[int]:
    return [60 - turn, 50 + turn]  # the deterministic "tool"


def episode(max_turns: int = 3, budget: int = BUDGET) -> tuple[list[int], list[int], int]:
    """What the fake engine gives for a whole episode answered by `answer`: (response ids in
    context order, loss mask, turns)."""
    ctx, resp, mask, out, turns = list(PROMPT), [], [], 0, 0
    while out < budget:
        tok = next_token(ctx, 64)
        ctx.append(tok)
        resp.append(tok)
        mask.append(1)
        out += 1
        if tok == EOS:
            return resp, mask, turns + 1
        if tok in STOPS:
            turns += 1
            if turns >= max_turns or out >= budget:
                return resp, mask, turns
            ctx += answer(turns)
            resp += answer(turns)
            mask += [0, 0]
    return resp, mask, turns + 1


def spec(gid: str, max_turns: int = 3, n: int = 1) -> GroupSpec:
    return GroupSpec(
        gid,
        n=n,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": BUDGET, "temperature": 0.0},
        turns=TurnsSpec(stop_token_ids=STOPS, max_turns=max_turns),
    )


def make(path: Path, delay_s: float = 0.002) -> RolloutManager:
    return RolloutManager(FakeEngine(delay_s=delay_s), BufferStore(path / "b.sqlite"))


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


# ---- pure rules ------------------------------------------------------------------------------


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


# ---- calls -----------------------------------------------------------------------------------


async def drive(
    mgr: RolloutManager, req: RolloutReq, on_event: Any = None
) -> tuple[Any, list[StreamEvent]]:
    """Run a streamed call, answering every awaiting member with `answer` (unless `on_event`
    says otherwise by returning False)."""
    events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
    task = asyncio.create_task(mgr.rollout(req, events))
    seen: list[StreamEvent] = []
    while not (task.done() and events.empty()):
        getter = asyncio.ensure_future(events.get())
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            continue
        ev = getter.result()
        assert ev is not None
        seen.append(ev)
        if on_event is not None and await on_event(ev) is False:
            continue
        if isinstance(ev, SampleAwaitingEvent):
            await mgr.post_input(ev.sample.sample_id, InputReq(append_ids=answer(ev.turn)))
    return task.result(), seen


def test_a_streamed_call_runs_whole_episodes_with_answers(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path)
        resp, seen = await drive(
            mgr, RolloutReq(groups=[spec("a"), spec("b", 2)], target_groups=2, stream=True)
        )
        for g in resp.groups:
            (s,) = g.samples
            want, mask, turns = episode(3 if g.group_id == "a" else 2)
            assert s.response_ids == want and s.loss_mask == mask, g.group_id
            assert len(s.turns) == turns
            assert all(t.awaited_s is not None for t in s.turns[:-1])
            assert sum(1 for a in s.appended for _ in a.ids) == mask.count(0)
        awaited = [e for e in seen if isinstance(e, SampleAwaitingEvent)]
        assert awaited and all(e.turn_ids[-1] in STOPS for e in awaited)
        mgr.check_integrity()

    asyncio.run(go())


def test_answer_after_the_call_is_durable_and_the_next_call_goes_on(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path)
        never = RolloutReq(groups=[spec("a"), spec("filler", 1)], target_groups=1, stream=True)

        async def no_answer(ev: StreamEvent) -> bool:
            return False  # nobody answers: the call ends at its quota, "a" stays awaiting

        first, _ = await drive(mgr, never, no_answer)
        assert [g.group_id for g in first.groups] == ["filler"]
        (s,) = (await mgr.buffer.read_group("a")).samples
        assert s.status == "awaiting_input"
        assert (await mgr.show_partial("a")).state == "awaiting"
        assert (await mgr.stats())["awaiting_input_samples"] == 1
        with pytest.raises(ApiError) as exc:  # nothing to run: a call cannot use it
            await mgr.rollout(RolloutReq(groups=[], target_groups=1))
        assert exc.value.code == "invalid_target"
        r = await mgr.post_input("a/0", InputReq(append_ids=answer(1)))
        assert r.batch_id is None and r.sample.status == "partial"
        with pytest.raises(ApiError) as exc:
            await mgr.post_input("a/0", InputReq(append_ids=answer(1)))
        assert exc.value.code == "not_awaiting"
        for bad in ("nope/0", "a/7", "a"):
            with pytest.raises(ApiError) as exc:
                await mgr.post_input(bad, InputReq(append_ids=[1]))
            assert exc.value.status == 404
        mgr.check_integrity()
        # A restart keeps the answer.
        mgr.store.close()
        mgr = make(tmp_path)
        (s,) = (await mgr.buffer.read_group("a")).samples
        assert s.status == "partial" and s.appended[-1].ids == answer(1)
        second, _ = await drive(
            mgr, RolloutReq(groups=[], target_groups=1, stream=True, turns=TURNS)
        )
        (s,) = second.groups[0].samples
        want, mask, _ = episode()
        assert s.response_ids == want and s.loss_mask == mask
        mgr.check_integrity()

    asyncio.run(go())


def test_an_abort_ends_a_call_waiting_for_answers_and_keeps_them_awaiting(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr = make(tmp_path)
        req = RolloutReq(groups=[spec("a")], target_groups=1, stream=True)

        async def abort_instead(ev: StreamEvent) -> bool:
            if isinstance(ev, SampleAwaitingEvent):
                await mgr.abort(AbortReq(all=True))
            return False

        resp, seen = await asyncio.wait_for(drive(mgr, req, abort_instead), 30)
        assert resp.groups == [] and resp.buffered_group_ids == ["a"]
        (s,) = (await mgr.buffer.read_group("a")).samples
        assert s.status == "awaiting_input"
        await mgr.post_input("a/0", InputReq(append_ids=answer(1)))  # kept, waits idle
        mgr.check_integrity()

    asyncio.run(go())


def test_the_wind_down_says_which_members_it_interrupted(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path, delay_s=0.004)
        slow = GroupSpec(
            "slow",
            input_ids=PROMPT,
            sampling_params={"max_new_tokens": 400, "ignore_eos": True},
            turns=TurnsSpec(stop=["</call>"]),  # the fake engine matches no text: never ends
        )
        quick = GroupSpec("quick", input_ids=[1, 2], sampling_params={"max_new_tokens": 5})
        resp, seen = await drive(
            mgr, RolloutReq(groups=[slow, quick], target_groups=1, stream=True)
        )
        cut = [e for e in seen if isinstance(e, SampleInterruptedEvent)]
        assert [(e.sample_id, e.turn, e.mid_turn) for e in cut] == [("slow/0", 1, True)]
        mgr.check_integrity()

    asyncio.run(go())


def test_a_call_without_turns_never_waits_for_answers(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = make(tmp_path)

        async def no_answer(ev: StreamEvent) -> bool:
            return False

        await drive(mgr, RolloutReq(groups=[spec("a", n=2), spec("f", 1)], stream=True), no_answer)
        g = await mgr.buffer.read_group("a")
        assert any(s.status == "awaiting_input" for s in g.samples)
        # A plain call (its caller cannot see who awaits) runs what it can and answers; an
        # older streamed client gets no turn events.
        for stream in (False, True):
            if all(s.status != "partial" for s in (await mgr.buffer.read_group("a")).samples):
                break
            req = RolloutReq(groups=[spec(f"x{stream}", 1)], target_groups=2, stream=stream)
            resp, seen = await asyncio.wait_for(drive(mgr, req, no_answer), 30)
            assert not resp.stats.quota_met
            assert not [e for e in seen if isinstance(e, SampleAwaitingEvent)]
        mgr.check_integrity()

    asyncio.run(go())


def test_an_answer_during_the_wind_down_is_not_lost(tmp_path: Path) -> None:
    """The answer arrives after the ending call persisted its groups but before it handed them
    back: it must be taken once the group is back in the buffer, not into the call's copy."""

    async def go() -> None:
        mgr = make(tmp_path)
        persist = mgr.persister.persist
        answers: list[asyncio.Task[Any]] = []

        async def late_persist(put: Any, delete: Any, call: Any = None) -> None:
            await persist(put, delete, call)
            waiting = [s for g in put for s in g.samples if s.status == "awaiting_input"]
            if (
                call is None
                and waiting
                and not answers
                and any(c.stopped for c in mgr.calls.values())
            ):
                req = InputReq(append_ids=answer(1))
                answers.append(asyncio.create_task(mgr.post_input(waiting[0].sample_id, req)))
                await asyncio.sleep(0.05)  # the answer runs while the call still holds it

        mgr.persister.persist = late_persist  # type: ignore[method-assign]

        async def no_answer(ev: StreamEvent) -> bool:
            return False

        req = RolloutReq(groups=[spec("a"), spec("f", 1)], target_groups=1, stream=True)
        await drive(mgr, req, no_answer)
        assert answers, "the wind-down never persisted an awaiting member"
        r = await answers[0]
        assert r.batch_id is None
        (s,) = (await mgr.buffer.read_group("a")).samples
        assert s.status == "partial" and [a.ids for a in s.appended] == [answer(1)]
        mgr.store.close()
        mgr = make(tmp_path)
        (s,) = (await mgr.buffer.read_group("a")).samples
        assert [a.ids for a in s.appended] == [answer(1)]  # durable

    asyncio.run(go())


def test_a_group_answered_before_its_retry_started_it_counts_once(tmp_path: Path) -> None:
    """Found by review: a retry of a request_id claims its attempt's groups by name, an agent
    group waiting for an answer among them. Answered while it still sat in the retry's ready
    queue, its member ran and ended the episode (the group finished and counted); then the
    queue handed it out with nothing left to run, and it counted again: the quota was met a
    group early and the response held the group twice."""

    async def go() -> None:
        mgr = make(tmp_path)
        long = GroupSpec(
            "h", n=1, input_ids=[1, 2, 3],
            sampling_params={"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0},
        )  # fmt: skip
        events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
        first = asyncio.create_task(
            mgr.rollout(
                RolloutReq(
                    groups=[spec("a", 2), long], target_groups=2, stream=True, request_id="r-1"
                ),
                events,
            )  # fmt: skip
        )
        while not isinstance(await events.get(), SampleAwaitingEvent):
            pass
        first.cancel()  # the client left: "a" awaits its answer, "h" is partial
        with pytest.raises(asyncio.CancelledError):
            await first
        # The retry: "h" ahead of "a" in its ready queue, one group at a time, two new groups
        # so that the quota of 3 needs "a", "h" and one of them.
        retry = RolloutReq(
            groups=[long, spec("a", 2), spec("x", 1), spec("y", 1)], target_groups=3,
            max_inflight_groups=1, request_id="r-1",
        )  # fmt: skip
        call = asyncio.create_task(mgr.rollout(retry))
        await asyncio.sleep(0.05)
        assert "h/0" in mgr.segments.running and "a/0" not in mgr.segments.running
        await mgr.post_input("a/0", InputReq(append_ids=answer(1)))  # runs now, ends "a"
        r = await asyncio.wait_for(call, 30)
        ids = [g.group_id for g in r.groups]
        assert len(ids) == 3 and len(set(ids)) == 3, ids
        assert {"a", "h"} <= set(ids)
        mgr.check_integrity()

    asyncio.run(go())


def test_a_text_answer_is_tokenized_without_special_tokens(tmp_path: Path) -> None:
    """Found by review: `/samples/{id}/input {"text": ...}` tokenized the answer as a prompt,
    so a tokenizer that adds a BOS (Llama, Mistral, Gemma) put one before every answer,
    mid-context (the TRL helper tokenizes answers with add_special_tokens=False)."""
    BOS = 1

    class AddsBos(FakeEngine):
        def tokenize(self, text: str, special: bool = True) -> list[int]:
            return ([BOS] if special else []) + super().tokenize(text, special)

    async def go() -> None:
        mgr = RolloutManager(AddsBos(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        never = RolloutReq(groups=[spec("a"), spec("filler", 1)], target_groups=1, stream=True)

        async def no_answer(ev: StreamEvent) -> bool:
            return False

        await drive(mgr, never, no_answer)
        r = await mgr.post_input("a/0", InputReq(text="ok"))
        assert r.sample.appended[-1].ids == [111 % 64, 107 % 64]  # before the fix: BOS first
        mgr.check_integrity()

    asyncio.run(go())
