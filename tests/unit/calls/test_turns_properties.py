"""Property test of agent rollouts (`turns_in_call.py` and the operations beside it): random
interleavings of streamed calls whose members stop at turn stops, tool answers (late, repeated,
after the call), aborts, deletes and background calls, run concurrently over the fake engine.
Whatever the order: no group is lost or delivered twice, no member generates in two places at
once, every answer the server took is in its sample exactly once and in order (none lost, none
duplicated), a second answer for a turn is refused, and every generated token is the fake
engine's continuation of its context (answers included), so nothing generated before an
interruption was lost or changed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_client.protocol import (
    AbortReq,
    GroupSpec,
    InputReq,
    RolloutReq,
    Sample,
    SampleAwaitingEvent,
    StreamEvent,
    TurnsSpec,
)
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.wire.errors import ApiError
from april_server.wire.ids import split_sample_id
from tests.unit.fake_engine import EOS, next_token
from tests.unit.idle import idle_bodies
from tests.unit.runtime.test_background_properties import Watch

STOPS = [9, 17, 33, 41, 50]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["call", "call_continue", "abort", "abort_group", "delete", "answer"]),
        st.integers(1, 3),  # groups in a call / which group an abort names
        st.integers(10, 60),  # a budget
        st.floats(0.0, 0.04),  # a pause before it
        st.sampled_from(["now", "late", "twice", "never"]),  # how a call's answers come
    ),
    min_size=3,
    max_size=9,
)


def spec(gid: str, budget: int) -> GroupSpec:
    return GroupSpec(
        gid,
        input_ids=[7, 8],
        n=2,
        sampling_params={"max_new_tokens": budget, "temperature": 0.0},
        turns=TurnsSpec(stop_token_ids=STOPS, max_turns=3),
    )


def tool(sid: str, turn: int) -> list[int]:
    return [(len(sid) + turn) % 60 + 1, turn]


def check_tokens(s: Sample) -> None:
    """Every generated token continues its context as the fake engine would."""
    ctx = list(s.prompt_ids)
    pos = 0
    appended = list(s.appended)
    for i, tok in enumerate(s.output_ids):
        while appended and appended[0].at == i:
            ctx += appended.pop(0).ids
        assert tok == next_token(ctx, 64), (s.sample_id, i)
        ctx.append(tok)
        pos += 1
    if s.status == "awaiting_input":
        assert s.output_ids[-1] in STOPS and s.turns and s.turns[-1].end == len(s.output_ids)
    if s.status == "completed":
        assert s.output_ids[-1] == EOS


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS)
def test_turn_interleavings_lose_nothing(tmp_path_factory: Any, ops: list[Any]) -> None:
    path: Path = tmp_path_factory.mktemp("turns") / "b.sqlite"

    async def go() -> None:
        eng = Watch()
        mgr = RolloutManager(eng, Durable.open(path))
        created: set[str] = set()
        delivered: list[str] = []
        gone: set[str] = set()
        bodies: list[Any] = []
        taken: dict[str, list[list[int]]] = {}  # sample id -> answers the server took, in order
        pending: list[tuple[str, int]] = []  # awaiting events nobody answered yet

        async def answer(sid: str, turn: int, twice: bool = False) -> None:
            ids = tool(sid, turn)
            try:
                await mgr.post_input(sid, InputReq(append_ids=ids, turn=turn))
                taken.setdefault(sid, []).append(ids)
            except ApiError as exc:
                # Deleted or delivered meanwhile (unknown now), or answered: nothing else.
                if exc.code == "not_found":
                    gid, _ = split_sample_id(sid) or (sid, -1)
                    assert not mgr.buffer.known(gid), exc
                else:
                    assert exc.code in ("not_awaiting", "group_busy"), exc
                return
            if twice:
                try:
                    await mgr.post_input(sid, InputReq(append_ids=ids, turn=turn))
                except ApiError as exc:
                    assert exc.code == "not_awaiting", exc
                else:
                    raise AssertionError(f"{sid} took a second answer for turn {turn}")

        async def call(gids: list[str], budget: int, how: str, on_quota: Any) -> None:
            events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
            req = RolloutReq(
                groups=[spec(g, budget) for g in gids],
                target_groups=1,
                on_quota=on_quota,
                stream=True,
            )
            task = asyncio.create_task(mgr.rollout(req, events))
            late: list[asyncio.Task[None]] = []
            while not (task.done() and events.empty()):
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                ev = getter.result()
                if not isinstance(ev, SampleAwaitingEvent):
                    continue
                sid, turn = ev.sample.sample_id, ev.turn
                if how == "now" or how == "twice":
                    await answer(sid, turn, twice=how == "twice")
                elif how == "late":
                    late.append(asyncio.create_task(answer(sid, turn)))
                else:
                    pending.append((sid, turn))
                    await mgr.abort(AbortReq(group_ids=[ev.sample.group_id], keep="tokens"))
            r = task.result()
            await asyncio.gather(*late)
            delivered.extend(g.group_id for g in r.groups)
            bodies.extend(r.groups)

        async def one(k: int, op: str, n: int, budget: int, pause: float, how: str) -> None:
            await asyncio.sleep(pause)
            gids = [f"o{k}-{i}" for i in range(n)]
            try:
                if op.startswith("call"):
                    created.update(gids)
                    on_quota = "continue" if op == "call_continue" else "tokens"
                    await call(gids, budget, how, on_quota)
                elif op == "abort":
                    await mgr.abort(AbortReq(all=True, keep="tokens"))
                elif op == "abort_group" and created:
                    await mgr.abort(
                        AbortReq(group_ids=[sorted(created)[n - 1 if n <= len(created) else 0]]),
                    )
                elif op == "delete" and len(mgr.buffer.idle):
                    gid = next(iter(mgr.buffer.idle.oldest())).group_id
                    await mgr.delete(gid)
                    gone.add(gid)
                elif op == "answer" and pending:
                    await answer(*pending.pop(0))
            except ApiError as exc:
                # Ids are unique: only a delete or an abort naming a group that raced a call
                # (held, or delivered meanwhile) may be refused.
                assert op in ("delete", "abort_group"), exc
                assert exc.code in ("group_busy", "not_found"), exc
            mgr.check_integrity()  # after every operation, not only at the end

        # Every call is answered or aborts what it leaves unanswered, so every call ends.
        await asyncio.wait_for(asyncio.gather(*(one(k, *op) for k, op in enumerate(ops))), 120)
        for sid, turn in pending:  # answers that come after everything
            await answer(sid, turn)
        await mgr.abort(AbortReq(all=True, keep="tokens"))  # settle the background
        assert not mgr.segments.running and not eng.double, eng.double
        assert len(delivered) == len(set(delivered)), "a group was delivered twice"
        buffered = {e.group_id for e in mgr.buffer.idle.oldest()}
        assert not set(delivered) & buffered and not gone & buffered
        assert set(delivered) | buffered | gone == created
        for g in [*idle_bodies(mgr.buffer), *bodies]:
            for s in g.samples:
                check_tokens(s)
                # The answers it holds are exactly those the server took, once each, in order.
                assert [a.ids for a in s.appended] == taken.get(s.sample_id, []), s.sample_id
                answered = [t for t in s.turns if t.awaited_s is not None]
                assert len(answered) == len(s.appended)
                assert sum(x.end - x.start for x in s.segments) == len(s.output_ids)
        mgr.check_integrity()
        mgr.store.close()

    asyncio.run(go())
