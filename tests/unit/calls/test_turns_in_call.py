"""Agent rollouts inside a call (`calls/turns_in_call.py`): calls that stop members at turn
stops, continue an answered member under their quota, and wind down turn-safely (the pure turn
rules: `rules/test_turns.py`; answers outside a call: `operations/test_inputs.py`). Fake engine:
its tokens are a hash of the context, so `episode()` below is an independent oracle."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from april_client.protocol import (
    GroupSpec,
    InputReq,
    RolloutReq,
    SampleAwaitingEvent,
    SampleInterruptedEvent,
    StreamEvent,
    TurnsSpec,
)
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
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
    return RolloutManager(FakeEngine(delay_s=delay_s), Durable.open(path / "b.sqlite"))


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


def test_a_group_answered_before_its_retry_started_it_counts_once(tmp_path: Path) -> None:
    """Found by review: a retry of a request_id claims its attempt's groups by name, an agent
    group waiting for an answer among them. Answered while it still sat in the retry's ready
    queue, its member ran and ended the episode (the group finished and counted); then the
    queue handed it out with nothing left to run, and it counted again: the quota was met a
    group early and the response held the group twice."""

    async def go() -> None:
        mgr = make(tmp_path)
        long = GroupSpec(
            "h",
            n=1,
            input_ids=[1, 2, 3],
            sampling_params={"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0},
        )
        events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
        first = asyncio.create_task(
            mgr.rollout(
                RolloutReq(
                    groups=[spec("a", 2), long], target_groups=2, stream=True, request_id="r-1"
                ),
                events,
            )
        )
        while not isinstance(await events.get(), SampleAwaitingEvent):
            pass
        first.cancel()  # the client left: "a" awaits its answer, "h" is partial
        with pytest.raises(asyncio.CancelledError):
            await first
        # The retry: "h" ahead of "a" in its ready queue, one group at a time, two new groups
        # so that the quota of 3 needs "a", "h" and one of them.
        retry = RolloutReq(
            groups=[long, spec("a", 2), spec("x", 1), spec("y", 1)],
            target_groups=3,
            max_inflight_groups=1,
            request_id="r-1",
        )
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
