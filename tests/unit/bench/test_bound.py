"""The no-bubble bound (`bound.py`): its levels, its time shares, its token count from the
engine clock, its knee; and the phase end to end against a fake engine whose clock counts what
its `/generate` made."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request

from april_bench import bound as bound_mod
from april_bench.bound import (
    Bound,
    BoundLevel,
    bound_line,
    keep_faster,
    level_budgets,
    levels,
    mean_need,
    measure_again,
    measure_bound,
    window_tokens,
)
from april_bench.workload import Workload


def level(c: int, tok_s: float, batch: float | None = None) -> BoundLevel:
    return BoundLevel(c, 1.0, int(tok_s), batch, None, None, None, None, True)


def test_levels_double_up_to_what_the_engine_holds() -> None:
    assert levels(100) == [8, 16, 32, 64, 100]
    assert levels(64) == [8, 16, 32, 64]
    assert levels(5) == [5]


def test_bigger_levels_get_more_of_the_phase() -> None:
    budgets = level_budgets([8, 16, 32, 64, 128], 62.0)
    assert budgets[-1] == pytest.approx(62.0 * 128 / 248)
    assert budgets[0] == pytest.approx(2.5 * bound_mod.MIN_WINDOW_S)  # the floor


def test_window_tokens_are_decode_tokens_plus_one_first_token_per_prefill() -> None:
    before = {"decode_tokens": 100.0, "prefill_requests": 4.0, "decode_s": 1.0}
    after = {"decode_tokens": 1100.0, "prefill_requests": 14.0, "decode_s": 2.0}
    tokens, delta = window_tokens(before, after)
    assert tokens == 1010 and delta["decode_s"] == 1.0


def test_the_bound_is_the_best_level_and_the_knee_the_smallest_near_it() -> None:
    b = Bound(
        levels=[
            level(8, 2000, 8),
            level(16, 4000, 15.6),
            level(32, 5900, 31),
            level(64, 6000, 62),
            level(128, 5800, 120),
        ]
    )
    assert b.tok_s == 6000 and b.best is not None and b.best.concurrency == 64
    assert b.knee is not None and b.knee.concurrency == 32  # 5900 >= 0.95 x 6000
    assert b.full_batch == 31
    js = b.to_json()
    assert js["bound_tok_s"] == 6000 and js["bound_knee_concurrency"] == 32
    assert "6000.0 tok/s at concurrency 64" in bound_line(js)
    assert Bound().tok_s is None and Bound().full_batch is None


def test_mean_need_is_prompt_plus_the_clipped_lognormal_mean() -> None:
    wl = Workload("longtail", 4, 512)
    need = mean_need(wl, 512)
    # Median 77 tokens, mean above it (the tail), below the maximum; prompts 16-64 tokens.
    assert 40 + 77 < need < 40 + 200


class FakeEngine:
    """`/generate` answers at once with its budget; the clock counts those tokens as one
    prefill (the first) and decode steps (the rest) at a fixed cost per token, in steps of
    `holds` requests (what its KV pool holds)."""

    def __init__(self, max_running: int = 16, holds: int = 16) -> None:
        self.holds = holds
        self.clock = {
            "decode_tokens": 0.0,
            "decode_batches": 0.0,
            "decode_s": 0.0,
            "prefill_s": 0.0,
            "prefill_requests": 0.0,
            "decode_context_tokens": 0.0,
        }
        self.max_running = max_running
        self.aborted: list[str] = []
        self.rids: list[str] = []
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.failing = False
        self.app = FastAPI()
        self.app.post("/generate")(self.generate)
        self.app.post("/abort_request")(self.abort)
        self.app.get("/april/v1/stats")(
            lambda: {
                "engine_time": dict(self.clock),
                "max_running_requests": self.max_running,
                "max_total_tokens": 10**6,
            }
        )

    async def generate(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.rids.append(body["rid"])
        if self.failing:
            raise HTTPException(500, "failing")
        self.prompts[body["rid"]] = tuple(body["input_ids"])
        k = body["sampling_params"]["max_new_tokens"]
        await asyncio.sleep(0.001)
        self.clock["prefill_requests"] += 1
        self.clock["decode_tokens"] += k - 1
        self.clock["decode_batches"] += (k - 1) / self.holds
        self.clock["decode_s"] += 0.0001 * k
        return {"output_ids": [7] * k, "meta_info": {"completion_tokens": k}}

    async def abort(self, request: Request) -> dict[str, Any]:
        self.aborted.append((await request.json())["rid"])
        return {}


def fake_http(app: FastAPI) -> httpx.AsyncClient:
    """A client whose requests `app` answers in process."""
    return httpx.AsyncClient(base_url="http://fake", transport=httpx.ASGITransport(app=app))


def test_the_phase_measures_every_level_and_stops_at_what_the_engine_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bound_mod, "MIN_WINDOW_S", 0.05)
    engine = FakeEngine(max_running=16)

    async def go() -> Bound:
        async with fake_http(engine.app) as http:
            return await measure_bound(http, Workload("longtail", 4, 64), 64, 1.0, 0.3)

    b = asyncio.run(go())
    assert [lv.concurrency for lv in b.levels] == [8, 16]
    assert b.capacity == (16, 10**6) and b.level_cap == 16
    assert all(lv.tokens > 0 and lv.window_s > 0 for lv in b.levels)
    assert b.tok_s is not None and "the most the engine holds" in b.stopped
    assert not any("-again-" in rid for rid in engine.rids)  # the second pass comes later


def measured_twice(
    engine: FakeEngine, between: Callable[[], None] = lambda: None
) -> tuple[list[BoundLevel], Bound]:
    """The bound's first pass, then (after `between`) its second, over the fake engine: the
    first pass's levels as it left them, and the bound after both."""
    wl = Workload("longtail", 4, 64)

    async def go() -> tuple[list[BoundLevel], Bound]:
        async with fake_http(engine.app) as http:
            b = await measure_bound(http, wl, 64, 1.0, 0.3)
            first = list(b.levels)
            between()
            await measure_again(http, wl, 64, 1.0, b)
            return first, b

    return asyncio.run(go())


def test_the_second_pass_measures_the_levels_up_to_the_best_on_prompts_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bound_mod, "MIN_WINDOW_S", 0.05)
    engine = FakeEngine(max_running=16)
    levels, b = measured_twice(engine)
    first = Bound(levels=levels).best
    assert first is not None
    again = [lv.concurrency for lv in b.levels if lv.other_tok_s is not None]
    assert again == [c for c in (8, 16) if c <= first.concurrency]
    best = b.best  # the first pass's best, or a smaller level whose second window beat it
    assert best is not None and best.other_tok_s is not None
    assert len(b.budgets) == len(b.levels) == 2
    again_prompts = {p for rid, p in engine.prompts.items() if "-again-" in rid}
    first_prompts = {p for rid, p in engine.prompts.items() if "-again-" not in rid}
    # prompts of its own: none found in the prefix cache
    assert again_prompts and not again_prompts & first_prompts


def test_a_level_measured_again_keeps_its_faster_window() -> None:
    def lv(c: int, tokens: int) -> BoundLevel:
        return BoundLevel(c, 1.0, tokens, float(c), 1.0, 100.0, 0.9, 0.0, True)

    kept = keep_faster([lv(8, 2800), lv(16, 5000), lv(32, 7000)], [lv(8, 3900), lv(16, 4900)])
    assert [(x.tok_s, x.other_tok_s) for x in kept] == [(3900, 2800), (5000, 4900), (7000, None)]
    assert "8: 3900 (batch 8) [2800]" in bound_line(Bound(levels=kept).to_json())


def test_the_phase_stops_once_the_running_batch_no_longer_follows_the_concurrency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bound_mod, "MIN_WINDOW_S", 0.05)
    engine = FakeEngine(max_running=64, holds=10)

    async def go() -> Bound:
        async with fake_http(engine.app) as http:
            return await measure_bound(http, Workload("longtail", 4, 64), 64, 1.0, 1.0)

    b = asyncio.run(go())
    assert [lv.concurrency for lv in b.levels] == [8, 16]  # 10 running of 16: full
    assert "averaged 10: the engine holds no more" in b.stopped


def test_a_short_phase_leaves_out_the_smallest_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bound_mod, "MIN_WINDOW_S", 0.05)
    engine = FakeEngine(max_running=64, holds=64)

    async def go() -> Bound:
        async with fake_http(engine.app) as http:
            # room for two levels of 2.5 minimal windows
            return await measure_bound(http, Workload("longtail", 4, 64), 64, 1.0, 0.26)

    assert [lv.concurrency for lv in asyncio.run(go()).levels] == [32, 64]


def test_a_server_without_an_engine_clock_gets_no_bound() -> None:
    app = FastAPI()
    app.get("/april/v1/stats")(lambda: {})

    async def go() -> Bound:
        async with fake_http(app) as http:
            return await measure_bound(http, Workload("longtail", 4, 64), 64, 1.0, 10.0)

    b = asyncio.run(go())
    assert b.levels == [] and b.tok_s is None and "no engine clock" in b.stopped
    assert "no engine clock" in bound_line(b.to_json())


def test_a_second_pass_that_fails_keeps_the_first_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bound_mod, "MIN_WINDOW_S", 0.05)
    engine = FakeEngine(max_running=16)
    first, b = measured_twice(engine, lambda: setattr(engine, "failing", True))
    assert [lv.tok_s for lv in b.levels] == [lv.tok_s for lv in first]
    assert "the second pass stopped: HTTP 500" in b.stopped
    assert asyncio.run(_again_without_budgets()) == []


async def _again_without_budgets() -> list[BoundLevel]:
    """A bound not measured by `measure_bound` has no time per level to give again."""
    b = Bound(levels=[BoundLevel(8, 1.0, 4000, 8.0, None, None, None, None, True)])
    async with httpx.AsyncClient(base_url="http://unused") as http:
        await measure_again(http, Workload("longtail", 4, 64), 64, 1.0, b)
    return [lv for lv in b.levels if lv.other_tok_s is not None]
