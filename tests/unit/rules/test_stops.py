"""A stop generated in the very step an abort lands (#36): SGLang then says `abort`, and the
segment must still be classified by what it produced. Pure rule (`stops.py`) and, over the fake
engine, an abort landing at every position of an agent episode, the stop's own step included:
whatever the position, the episode the server records (tokens, turns, answers) is the one an
uninterrupted run gives. The fake engine's abort-in-step mirrors SGLang's
`Req.update_finish_state`, which looks at `to_finish` before any stop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from april_client.protocol import GroupSpec, InputReq, RolloutReq, Sample, TurnsSpec
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.stops import reached_stop
from april_server.rules.turns import awaiting
from tests.unit.calls.test_turns_in_call import BUDGET, PROMPT, STOPS, answer, episode
from tests.unit.fake_engine import EOS, FakeEngine, next_token
from tests.unit.idle import idle_bodies


def text(ids: list[int]) -> str:
    return "".join(chr(0x30 + t) for t in ids)


def test_the_last_token_decides() -> None:
    params = {"stop_token_ids": [9], "stop": ["ab"]}
    assert reached_stop(params, [1], [4, 9], {EOS}, text) == 9
    assert reached_stop(params, [], [4, EOS], {EOS}, text) == EOS
    assert reached_stop(params, [], [9, 4], {EOS}, text) is None  # a stop earlier: not this
    assert reached_stop({**params, "ignore_eos": True}, [], [EOS], {EOS}, text) is None
    a, b = ord("a") - 0x30, ord("b") - 0x30
    assert reached_stop(params, [a], [b], set(), text) == "ab"  # across the segment boundary
    assert reached_stop(params, [a, b], [4], set(), text) is None  # it ended a token earlier
    assert reached_stop({**params, "ignore_eos": True}, [a], [b], set(), text) == "ab"
    assert reached_stop(params, [a], [b], set(), lambda ids: None) is None  # no tokenizer
    assert reached_stop(params, [], [], {EOS}, text) is None


def first_segment(rid: str) -> bool:
    """`rid` is `{sample_id}@{owner}.{segments before it}.{nonce}` (segment_runner.py)."""
    return rid.split("@")[1].split(".")[1] == "0"


def run_episode(
    tmp_path: Path, at: int, turns: TurnsSpec, answer_of: dict[int, list[int]]
) -> tuple[Sample, int]:
    """One member's whole episode; the first segment is aborted in the step of its `at`-th
    token. Non-streamed calls (they never wait for answers), answered in between. Returns
    the delivered sample and the calls it took."""

    async def go() -> tuple[Sample, int]:
        engine = FakeEngine(delay_s=0.0)
        engine.abort_in_step = lambda rid, n: first_segment(rid) and n == at
        mgr = RolloutManager(engine, Durable.open(tmp_path / f"b{at}.sqlite"))
        spec = GroupSpec(
            "e",
            input_ids=PROMPT,
            sampling_params={"max_new_tokens": BUDGET, "temperature": 0.0},
            turns=turns,
        )
        req = RolloutReq(groups=[spec], target_groups=1)
        for calls in range(1, 12):
            resp = await mgr.rollout(req)
            mgr.check_integrity()
            if resp.groups:
                return resp.groups[0].samples[0], calls
            (g,) = idle_bodies(mgr.buffer)
            s = g.samples[0]
            if awaiting(s):
                await mgr.post_input(s.sample_id, InputReq(append_ids=answer_of[s.turn]))
            req = RolloutReq(groups=[], target_groups=1)
        raise AssertionError("the episode never ended")

    return asyncio.run(go())


def test_an_abort_at_every_position_records_the_uninterrupted_episode(tmp_path: Path) -> None:
    resp, mask, turns = episode()
    generated = sum(mask)
    for at in range(1, generated + 1):
        answers = {k: answer(k) for k in range(1, 4)}
        s, _ = run_episode(tmp_path, at, TurnsSpec(stop_token_ids=STOPS, max_turns=3), answers)
        assert s.response_ids == resp, at
        assert s.loss_mask == mask, at
        assert len(s.turns) == turns, at
        for t in s.turns[:-1]:  # every turn but the last ended at a turn stop, and only there
            assert t.end_reason == "turn_stop" and s.output_ids[t.end - 1] in STOPS, at
            assert not set(s.output_ids[t.start : t.end - 1]) & set(STOPS), at


def test_a_stop_string_completed_in_the_aborts_step_ends_the_turn(tmp_path: Path) -> None:
    ctx: list[int] = list(PROMPT)
    for _ in range(6):  # the fake's generation from the prompt
        ctx.append(next_token(ctx, 64))
    ids = ctx[len(PROMPT) :]
    stop = text(ids[3:5])  # ends at the 5th token
    if stop in text(ids[:4]):
        pytest.skip("the fake's sequence has this text earlier")  # not the case for PROMPT
    s, _ = run_episode(tmp_path, 5, TurnsSpec(stop=[stop], max_turns=2), {1: [60, 61]})
    first = s.turns[0]
    assert (first.end, first.stop, first.end_reason) == (5, stop, "turn_stop")
    assert s.output_ids[:5] == ids[:5] and s.appended[0].at == 5
