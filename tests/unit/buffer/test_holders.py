"""One holder per group (`partial_buffer.py`'s holder map): hand-overs without windows. Each test
forces one window that the server had before: a decision of who holds a group, an `await`, and
only then its record. Fake engine (its tokens are a hash of the context); the store's reads can
be held on an event, so the test decides exactly where the hand-over is when a route addresses
the group."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from april_client.protocol import (
    AbortReq,
    Group,
    GroupSpec,
    InputReq,
    RolloutReq,
    RolloutResp,
    StreamEvent,
    TurnsSpec,
)
from april_server.buffer.store import BufferStore
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules import samples, turns
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import FakeEngine, next_token
from tests.unit.idle import idle_bodies

PROMPT = [5, 6, 7]
BUDGET = 400
ANSWER = [60, 61]


def quiet_token(prompt: list[int], n: int, vocab: int = 64) -> int:
    """A token the fake engine does not produce in the first `n` tokens after `prompt` (nor is
    EOS): as a turn stop, it never ends the runnable member's turn while the test runs."""
    ctx, seen = list(prompt), set()
    for _ in range(n):
        tok = next_token(ctx, vocab)
        seen.add(tok)
        ctx.append(tok)
    return min(t for t in range(3, vocab) if t not in seen)


STOP = quiet_token(PROMPT, BUDGET)
TURNS = TurnsSpec(stop_token_ids=[STOP])


class HeldStore(BufferStore):
    """A store whose next group read waits for `release` (once armed with `hold_next`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.armed = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    def hold_next(self) -> None:
        self.armed = True

    async def read_groups(self, group_ids: list[str]) -> dict[str, Group]:
        if self.armed:
            self.armed = False
            self.entered.set()
            await self.release.wait()
        return await super().read_groups(group_ids)


def make(path: Path, delay_s: float = 0.005) -> tuple[RolloutManager, HeldStore]:
    store = HeldStore(path / "b.sqlite")
    return RolloutManager(FakeEngine(delay_s=delay_s), Durable.load(store)), store


async def buffer_agent_group(mgr: RolloutManager, gid: str = "g") -> None:
    """An idle group of two: member 0 awaits the answer of its first turn, member 1 can run."""
    spec = GroupSpec(
        gid,
        n=2,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": BUDGET, "temperature": 0.0},
        turns=TURNS,
    )
    g = samples.build_group(spec, PROMPT, mgr.engine.context_len, mgr.engine.vocab_size)
    first = g.samples[0]
    samples.apply_segment(
        first, samples.SegmentResult([3, 4, STOP], [0.0] * 3, "stop", "0"), "fresh"
    )
    turns.end_of_segment(first, STOP)
    assert turns.awaiting(first)
    mgr.buffer.adopt([g], "setup")
    await mgr.persister.persist([g], [])
    mgr.buffer.release("setup")


def call_req(**kw: Any) -> RolloutReq:
    base: dict[str, Any] = dict(groups=[], target_groups=1, stream=True, turns=TURNS)
    base.update(kw)
    return RolloutReq(**base)


async def start_call(
    mgr: RolloutManager, req: RolloutReq
) -> tuple[asyncio.Task[RolloutResp], asyncio.Queue[StreamEvent | None]]:
    events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
    return asyncio.ensure_future(mgr.rollout(req, events)), events


async def settle(task: asyncio.Task[Any], mgr: RolloutManager) -> None:
    """End what still runs (the runnable member's long budget) and wait for the call."""
    await mgr.abort(AbortReq(all=True, keep="tokens"))
    await asyncio.wait_for(task, 30)
    mgr.check_integrity()


def test_an_answer_posted_while_a_call_reads_the_group_waits_and_reaches_that_call(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr, store = make(tmp_path)
        await buffer_agent_group(mgr)
        store.hold_next()
        task, _ = await start_call(mgr, call_req())
        await store.entered.wait()  # the call holds "g"; its body is still being read
        mgr.check_integrity()
        answer = asyncio.ensure_future(mgr.post_input("g/0", InputReq(append_ids=ANSWER)))
        await asyncio.sleep(0.05)
        assert not answer.done(), "the answer must wait out the read, not fail"
        store.release.set()
        resp = await asyncio.wait_for(answer, 10)
        call = next(iter(mgr.calls.values()))
        assert resp.batch_id == call.state.batch_id
        assert resp.sample.appended[-1].ids == ANSWER
        assert "g/0" in mgr.segments.running  # it continues at once, under the call
        await settle(task, mgr)

    asyncio.run(go())


def test_an_abort_during_the_read_makes_the_claiming_call_give_the_group_up(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        mgr, store = make(tmp_path)
        await buffer_agent_group(mgr)
        store.hold_next()
        task, _ = await start_call(mgr, call_req(stream=False, turns=None))
        await store.entered.wait()
        aborted = await mgr.abort(AbortReq(group_ids=["g"], keep="tokens"))
        assert {s.sample_id for s in aborted.samples} == {"g/0", "g/1"}
        store.release.set()
        resp = await asyncio.wait_for(task, 30)
        # Given up: nothing of it started after the abort answered; it stays buffered.
        assert not resp.stats.quota_met and resp.buffered_group_ids == ["g"]
        assert not [c for c in mgr.engine.calls if c[0].startswith("g/")]  # type: ignore[attr-defined]
        (g,) = idle_bodies(mgr.buffer)
        assert g.samples[1].output_ids == []
        mgr.check_integrity()

    asyncio.run(go())


def test_an_answer_waiting_for_the_background_to_pause_reaches_the_call_that_took_the_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> None:
        mgr, _ = make(tmp_path)
        await buffer_agent_group(mgr)
        bg = mgr.background
        bg.add(["g"], None)
        while "g/1" not in mgr.segments.running:  # the background runs member 1
            await asyncio.sleep(0.005)
        stop = bg._stop
        gate, waiting = asyncio.Event(), asyncio.Event()

        async def held_stop() -> None:  # only the answer's pause waits here
            if not waiting.is_set():
                waiting.set()
                await gate.wait()
            await stop()

        monkeypatch.setattr(bg, "_stop", held_stop)
        answer = asyncio.ensure_future(mgr.post_input("g/0", InputReq(append_ids=ANSWER)))
        await waiting.wait()
        task, _ = await start_call(mgr, call_req())
        while mgr.buffer.owner_of("g") == "background":  # the call takes it over, running
            await asyncio.sleep(0.005)
        call = next(iter(mgr.calls.values()))
        assert mgr.buffer.owner_of("g") == call.state.batch_id
        gate.set()
        resp = await asyncio.wait_for(answer, 10)
        assert resp.batch_id == call.state.batch_id and resp.sample.appended[-1].ids == ANSWER
        await settle(task, mgr)

    asyncio.run(go())


def test_turn_stop_ids_under_ignore_eos_are_refused(tmp_path: Path) -> None:
    async def go() -> None:
        mgr, _ = make(tmp_path)
        for where in ("group", "call", "member"):
            spec = GroupSpec(
                "x",
                input_ids=PROMPT,
                sampling_params={"max_new_tokens": 8, "ignore_eos": where != "member"},
                member_params=[{"ignore_eos": True}] if where == "member" else None,
                turns=TURNS if where != "call" else None,
            )
            req = RolloutReq(
                groups=[spec], target_groups=1, turns=TURNS if where == "call" else None
            )
            with pytest.raises(ApiError) as exc:
                await mgr.rollout(req)
            assert exc.value.code == "invalid_turns" and exc.value.status == 400, where
        # Stop strings still end turns under ignore_eos: allowed.
        ok = GroupSpec(
            "y",
            input_ids=PROMPT,
            sampling_params={"max_new_tokens": 8, "ignore_eos": True},
            turns=TurnsSpec(stop=["</call>"]),
        )
        resp = await mgr.rollout(RolloutReq(groups=[ok], target_groups=1))
        assert resp.stats.quota_met
        mgr.check_integrity()

    asyncio.run(go())
