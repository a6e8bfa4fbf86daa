"""The weight cut (`engine/weight_cut.py`) as the segment runner drives it: a push cuts a
running segment, holds it and continues it under the new version; a segment planned before
the push waits for it; a stop while the cut holds a segment keeps what the old weights made,
or nothing if it never ran; a cut sample is recorded in the length census. Over the fake
engine, as in `test_segment_runner.py`, whose helpers these use."""

from __future__ import annotations

import asyncio
from typing import Any

from april_server.engine.base import EngineUnavailable
from april_server.rules.goodput import LengthCensus
from april_server.rules.placement import Slot
from tests.unit.engine.test_segment_runner import (
    generating,
    group,
    runner_over,
    start_group,
    uninterrupted,
)
from tests.unit.fake_engine import FakeEngine
from tests.unit.waiting import until


def test_a_weight_update_cuts_a_segment_holds_it_and_continues_it_under_the_new_version() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        runner = runner_over(eng)
        g, tally, (task,) = await generating(eng, runner, 300)
        (s,) = g.samples
        await runner.weight_cut.before_update()
        run = runner.running["g/0"]
        await until(lambda: run.resuming)  # cut, and held until the update ends
        await asyncio.sleep(0.03)
        assert len(eng.calls) == 1 and not task.done()
        eng.version = "1"
        runner.weight_cut.after_update()
        await task
        assert s.output_ids == uninterrupted(300)
        assert [seg.weight_version for seg in s.segments] == ["0", "1"]
        assert runner.versions.history == ["0", "1"] and len(eng.calls) == 2
        assert tally.output_tokens == 300 and not runner.running

    asyncio.run(go())


def test_a_segment_planned_before_an_update_waits_for_it_and_runs_under_the_new_version() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        runner = runner_over(eng)
        await runner.weight_cut.before_update()  # nothing running: the update is under way
        g = group("g", 20)
        (s,) = g.samples
        _, (task,) = start_group(runner, g)
        assert runner.running["g/0"].planned_version == "0"
        await asyncio.sleep(0.05)
        assert eng.calls == []  # held: nothing generates on half-loaded weights
        eng.version = "1"
        runner.weight_cut.after_update()
        await task
        assert s.output_ids == uninterrupted(20)
        assert [seg.weight_version for seg in s.segments] == ["1"] and len(eng.calls) == 1

    asyncio.run(go())


def test_a_segment_stopped_while_an_update_holds_it_ends_having_generated_nothing() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        runner = runner_over(eng)
        await runner.weight_cut.before_update()
        g = group("g", 20)
        (s,) = g.samples
        _, (task,) = start_group(runner, g)
        await asyncio.sleep(0.02)
        await asyncio.wait_for(runner.stop(list(runner.running.values())), 2.0)
        assert task.done() and not runner.running
        assert eng.calls == [] and (s.output_ids, s.segments, s.status) == ([], [], "partial")
        runner.weight_cut.after_update()

    asyncio.run(go())


def test_a_cut_segment_stopped_during_the_update_keeps_what_the_old_weights_made() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        runner = runner_over(eng)
        g, _, _ = await generating(eng, runner, 300)
        (s,) = g.samples
        await runner.weight_cut.before_update()
        run = runner.running["g/0"]
        await until(lambda: run.resuming)
        await asyncio.wait_for(runner.stop([run], keep="tokens"), 2.0)
        kept = len(s.output_ids)
        assert 0 < kept < 300 and s.output_ids == uninterrupted(kept)
        assert [seg.weight_version for seg in s.segments] == ["0"] and s.status == "partial"
        assert len(eng.calls) == 1 and not runner.running
        runner.weight_cut.after_update()

    asyncio.run(go())


class GoneAcrossAnUpdate(FakeEngine):
    """Its next segment waits at the engine until `gone` is set, then the engine is gone."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.002)
        self.gone: asyncio.Event | None = None

    async def generate(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> Any:
        if self.gone is not None:
            gone, self.gone = self.gone, None
            await gone.wait()
            raise EngineUnavailable(Slot(), "connection lost")
        return await super().generate(rid, input_ids, params)


def test_a_segment_planned_again_after_its_engine_went_away_is_judged_under_the_new_version() -> (
    None
):
    """Found by the simulator (seed 13832 with faults: an owner whose push failed on one
    engine): a segment planned under version 0 whose engine went away after a push to version
    1 was planned again elsewhere with the continuation planned before the push, so it ran
    under version 1 without its owner's max_staleness being applied (0 here: it must restart
    from its prompt)."""

    async def go() -> None:
        eng = GoneAcrossAnUpdate()
        runner = runner_over(eng)
        g, _, tasks = await generating(eng, runner, 40)
        await runner.stop(list(runner.running.values()), "tokens")
        await asyncio.gather(*tasks)
        (s,) = g.samples
        assert [seg.weight_version for seg in s.segments] == ["0"]
        eng.gone = gone = asyncio.Event()
        _, (task,) = start_group(runner, g, max_staleness=0)  # continues: its segment is new
        await until(lambda: len(eng.calls) == 1 and "g/0" in runner.running)
        await asyncio.sleep(0.01)  # at the engine, which holds it
        await runner.weight_cut.before_update()
        eng.version = "1"
        runner.weight_cut.after_update()
        gone.set()  # the engine goes away: the segment is planned again elsewhere
        await task
        assert s.staleness_restarts == 1  # before the fix: 0, a version-0 segment continued
        assert [seg.weight_version for seg in s.segments] == ["1"]
        assert s.output_ids == uninterrupted(40)

    asyncio.run(go())


def test_a_cut_sample_is_recorded_in_the_census_as_at_least_as_long_as_it_got() -> None:
    """A call's end records a running sample without the segment it is in the middle of (its
    tokens are the engine's until it ends): each push's cut records what it made by then."""

    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        made_by: dict[str, int] = {}  # request id -> tokens it has made (the engine's count)
        eng.abort_in_step = lambda rid, n: made_by.__setitem__(rid, n) or False
        runner = runner_over(eng)
        cut = runner.weight_cut
        cut.census = census = LengthCensus()
        g, _, (task,) = await generating(eng, runner, 300)
        (s,) = g.samples
        run = runner.running["g/0"]
        seen = []
        for version in ("1", "2"):
            # Its current request has made a token: the cut has something to record.
            await until(lambda: made_by.get(eng.calls[-1][0], 0) >= 1)
            await cut.before_update()
            await until(lambda: run.resuming)  # landed: recorded before the sample records it
            tokens, finished = census.seen["g/0"]
            assert not finished and tokens == len(s.output_ids) + made_by[eng.calls[-1][0]]
            seen.append(tokens)
            eng.version = version
            cut.after_update()
            await until(lambda: len(eng.calls) == len(seen) + 1)  # its continuation
        await task
        assert seen[0] < seen[1] < 300
        assert [seg.end for seg in s.segments[:2]] == seen
        assert [seg.weight_version for seg in s.segments] == ["0", "1", "2"]

    asyncio.run(go())
