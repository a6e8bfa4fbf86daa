"""`POST /samples/{id}/input` (`operations/inputs.py`): a tool's answer for a member awaiting
input, taken durably when no call holds it, never lost while a call winds down, and a text
answer tokenized as a continuation (no special tokens). Fake engine: its tokens are a hash of
the context, so `episode()` is an independent oracle."""

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
    SampleAwaitingEvent,
    StreamEvent,
)
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.wire.errors import ApiError
from tests.unit.calls.test_turns_in_call import TURNS, answer, drive, episode, make, spec
from tests.unit.fake_engine import FakeEngine


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
                and any(c.state.stopped for c in mgr.calls.values())
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


def test_an_answer_for_a_group_its_call_gave_up_names_the_call(tmp_path: Path) -> None:
    """Found by the simulator (seed 8763 with faults: a commit failing like a full disk): an
    answer for a group its call had given up (an abort named it) was taken into the call's
    copy, durable only with the call's outcome, but answered with batch_id null ("made
    durable already"); the call's commit failed, and the answer was gone."""

    async def go() -> None:
        mgr = make(tmp_path)
        params = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0.0}
        long = GroupSpec("long", input_ids=[1, 2, 3], sampling_params=params)
        req = RolloutReq(groups=[spec("a"), long], target_groups=2, stream=True)
        answered: list[Any] = []

        async def abort_then_answer(ev: StreamEvent) -> bool:
            if isinstance(ev, SampleAwaitingEvent) and not answered:
                await mgr.abort(AbortReq(group_ids=["a"]))  # the call gives "a" up, runs on
                answered.append(await mgr.post_input("a/0", InputReq(append_ids=answer(1))))
                assert not mgr.segments.is_running("a/0")  # not continued: it waits idle
            return False

        resp, _ = await drive(mgr, req, abort_then_answer)
        assert answered and answered[0].batch_id == resp.batch_id  # before the fix: None
        (s,) = (await mgr.buffer.read_group("a")).samples  # durable with the call's outcome
        assert s.status == "partial" and [x.ids for x in s.appended] == [answer(1)]
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
        mgr = RolloutManager(AddsBos(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        never = RolloutReq(groups=[spec("a"), spec("filler", 1)], target_groups=1, stream=True)

        async def no_answer(ev: StreamEvent) -> bool:
            return False

        await drive(mgr, never, no_answer)
        r = await mgr.post_input("a/0", InputReq(text="ok"))
        assert r.sample.appended[-1].ids == [111 % 64, 107 % 64]  # before the fix: BOS first
        mgr.check_integrity()

    asyncio.run(go())
