"""The segment runner (`engine/segment_runner.py`): starting a group's members (and only
those that can run), what a stop keeps (tokens, nothing, a snapshot), freeing and refreshing
snapshots, staleness restarts, engine failures and waits for a healthy slot, the predicted
lengths it writes and scores, its admission bound, which follows the engine's pool, and no
snapshot policy over an engine without snapshots. Fake engine: a token is a hash of its
context, so `uninterrupted` says what any sample must hold however its segments were cut. A
weight update's cut, hold and replan: `test_weight_cut.py`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from april_client.protocol import Group, RolloutReq, Sample
from april_server.engine import segment_runner
from april_server.engine.base import EngineUnavailable
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import CallTally
from april_server.fleet.engine_wire import encoder
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules import samples
from april_server.rules.inflight import EngineCapacity
from april_server.rules.placement import Slot
from april_server.rules.samples import SegmentResult
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import FakeEngine, SnapshotFakeEngine, next_token, segment_runner_over
from tests.unit.fleet.test_fleet import FakeServers, fleet_over
from tests.unit.group_specs import spec
from tests.unit.rules.test_snapshots import sample
from tests.unit.waiting import until

# ---- through the manager: the admission bound, a segment's unexpected failure --------------


class FiguredServers(FakeServers):
    """Also answers `/figures` with a capacity per engine."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/april/v1/engine/figures":
            return httpx.Response(200, content=encoder.encode({"capacity": [10, 1000]}))
        return await super().__call__(request)


def test_admission_is_sized_again_when_the_pool_changes() -> None:
    async def go() -> None:
        servers = FiguredServers(["a:1", "b:1"])
        fleet = fleet_over(servers, ["a:1", "b:1"])
        await fleet.probe_all()
        mgr = RolloutManager(fleet, Durable.open(None))
        one = EngineCapacity(10, 1000)
        await mgr.segments.planner.admission_ready()
        two = mgr.admission.max_samples
        servers.gone.add("b:1")
        await fleet.probe_all()  # b leaves the pool
        await mgr.segments.planner.admission_ready()
        alone = mgr.admission.max_samples
        assert alone < two  # before the fix: sized once, for two engines, for good
        check = type(mgr.admission)()
        check.configure(one)
        assert alone == check.max_samples
        await fleet.close()

    asyncio.run(go())


def test_an_unexpected_error_in_a_segment_leaves_the_sample_free_to_run(tmp_path: Path) -> None:
    """Found by review: an exception out of a segment's task (an engine's malformed answer
    decoded while settling a weight update's cut) skipped taking the sample out of
    `running`: every later start refused it as still generating, for the server's life. Now
    it is logged, and the sample keeps what it had, as after an engine error."""

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        real = mgr.segments._one_segment
        failures = [1]

        async def malformed_once(*args: Any) -> Any:
            if failures[0]:
                failures[0] -= 1
                raise ValueError("malformed /kv answer")
            return await real(*args)

        mgr.segments._one_segment = malformed_once  # type: ignore[method-assign]
        first = await mgr.rollout(RolloutReq(groups=[spec("a", 20)], target_groups=1))
        assert not first.stats.quota_met and first.buffered_group_ids == ["a"]
        assert "a/0" not in mgr.segments.running  # before the fix: held there for good
        r = await mgr.rollout(RolloutReq(groups=[], target_groups=1))
        assert [g.group_id for g in r.groups] == ["a"]
        assert len(r.groups[0].samples[0].output_ids) == 20
        mgr.check_integrity()

    asyncio.run(go())


# ---- the runner on its own, over the fake engine ---------------------------------------------

PROMPT = [1, 2, 3]  # the prompt of `group_specs.spec`
VOCAB = 64  # the fake engine's


def uninterrupted(n: int) -> list[int]:
    """The fake engine's first `n` tokens after PROMPT, in one go: the oracle for any sample
    however its segments were cut (a token is a hash of the whole context)."""
    ctx, out = list(PROMPT), []
    for _ in range(n):
        out.append(next_token(ctx, VOCAB))
        ctx.append(out[-1])
    return out


def group(gid: str, budget: int, n: int = 1) -> Group:
    return samples.build_group(spec(gid, budget, n), PROMPT, 512, VOCAB)


# The only places below that build a runner or start its segments: a change of the runner's
# constructor or of `start`/`start_group` is made here once.


def runner_over(engine: FakeEngine, allow_stale: bool = False) -> SegmentRunner:
    return segment_runner_over(engine, allow_stale)


def start_group(
    runner: SegmentRunner, g: Group, max_staleness: int | None = None
) -> tuple[CallTally, list[asyncio.Task[None]]]:
    tally: CallTally = CallTally()
    return tally, runner.start_group(g, "call-1", tally, max_staleness)


def start(
    runner: SegmentRunner,
    s: Sample,
    owner: str,
    tally: CallTally | None = None,
    max_staleness: int | None = None,
) -> asyncio.Task[None]:
    """The next segment of one sample, for `owner` (a call's id)."""
    return runner.start(s, owner, CallTally() if tally is None else tally, max_staleness)


async def generating(
    eng: FakeEngine, runner: SegmentRunner, budget: int, n: int = 1
) -> tuple[Group, CallTally, list[asyncio.Task[None]]]:
    """Group "g" of `n` members started, at the engine and generating for a while."""
    g = group("g", budget, n)
    tally, tasks = start_group(runner, g)
    await until(lambda: len(eng.calls) == n)
    await asyncio.sleep(0.03)
    return g, tally, tasks


def test_a_group_runs_every_member_to_its_budget_and_gives_back_what_it_took() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        runner = runner_over(eng)
        g = group("g", 10, n=3)
        tally, tasks = start_group(runner, g)
        assert len(tasks) == 3 and set(runner.running) == {"g/0", "g/1", "g/2"}
        assert runner.admission.samples == 3 and runner.admission.tokens > 0
        assert runner.planner.by_slot()[0]["running_samples"] == 3
        await asyncio.gather(*tasks)
        assert all(s.output_ids == uninterrupted(10) for s in g.samples)
        assert {(s.status, s.finish_reason) for s in g.samples} == {("truncated", "length")}
        assert tally.output_tokens == runner.counters.output_tokens == 30
        assert not runner.running
        assert (runner.admission.samples, runner.admission.tokens) == (0, 0.0)
        assert runner.planner.by_slot()[0]["running_samples"] == 0
        assert runner.planner.by_slot()[0]["kv_need_tokens"] == 0

    asyncio.run(go())


def test_a_group_starts_only_its_members_that_can_run() -> None:
    async def go() -> None:
        runner = runner_over(FakeEngine(delay_s=0.002))
        g = group("g", 10, n=4)
        done, spent, answered, fresh = g.samples
        done.status, done.finish_reason = "completed", "stop"
        spent.max_new_tokens = 0
        early = start(runner, answered, "call-1")  # it runs before its group does
        tally, tasks = start_group(runner, g)
        assert len(tasks) == 1 and set(runner.running) == {answered.sample_id, fresh.sample_id}
        assert (spent.status, spent.finish_reason) == ("truncated", "length")
        await asyncio.gather(early, *tasks)
        assert done.output_ids == [] and spent.output_ids == []
        assert answered.output_ids == fresh.output_ids == uninterrupted(10)

    asyncio.run(go())


def test_a_sample_already_generating_is_not_started_twice() -> None:
    async def go() -> None:
        runner = runner_over(FakeEngine(delay_s=0.002))
        (s,) = group("g", 10).samples
        task = start(runner, s, "call-1")
        with pytest.raises(ApiError) as err:
            start(runner, s, "call-2")
        assert (err.value.status, err.value.code) == (409, "sample_running")
        await task
        assert s.output_ids == uninterrupted(10)

    asyncio.run(go())


def test_lengths_are_predicted_as_a_group_starts_and_scored_as_its_members_end() -> None:
    async def go() -> None:
        runner = runner_over(FakeEngine(delay_s=0.001))
        first = group("first", 8, n=2)
        _, tasks = start_group(runner, first)
        assert [s.predicted_tokens for s in first.samples] == [None, None]  # no evidence yet
        await asyncio.gather(*tasks)
        assert runner.lengths.finished_count == 2 and runner.lengths.prior == 8.0
        later = group("later", 20)  # same prompt: its history predicts 8, not the budget
        _, tasks = start_group(runner, later)
        (s,) = later.samples
        assert (s.predicted_tokens, s.predicted_remaining) == (8, 8)
        await asyncio.gather(*tasks)
        assert len(s.output_ids) == 20 and s.predicted_remaining == 0
        score = runner.lengths.score
        assert (score.scored, score.abs_error, score.signed_error) == (1, 12, -12)

    asyncio.run(go())


def test_a_stop_keeping_tokens_leaves_a_partial_that_resumes_to_the_same_output() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        runner = runner_over(eng)
        g, _, _ = await generating(eng, runner, 300)
        (s,) = g.samples
        await runner.stop(list(runner.running.values()), keep="tokens")
        assert not runner.running and s.status == "partial" and s.finish_reason is None
        kept = len(s.output_ids)
        assert 0 < kept < 300 and s.output_ids == uninterrupted(kept)
        tally = CallTally()
        await start(runner, s, "call-2", tally)
        assert s.output_ids == uninterrupted(300)
        assert [seg.kv for seg in s.segments] == ["fresh", "recomputed"]
        assert tally.resumed_samples == runner.counters.resumed_samples == 1
        assert tally.output_tokens == 300 - kept

    asyncio.run(go())


def test_a_stop_keeping_nothing_forgets_what_an_unfinished_sample_made() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        runner = runner_over(eng)
        g, _, _ = await generating(eng, runner, 300)
        (s,) = g.samples
        await runner.stop(list(runner.running.values()), keep="drop")
        assert (s.output_ids, s.segments, s.status) == ([], [], "partial")
        assert not runner.running

    asyncio.run(go())


async def kept_snapshot(eng: SnapshotFakeEngine, runner: SegmentRunner, n: int = 1) -> Group:
    """Group "g" started, generating a while, every member stopped keeping a snapshot."""
    g, _, _ = await generating(eng, runner, 300, n)
    await runner.stop(list(runner.running.values()), keep="snapshot")
    return g


def test_a_stop_keeping_a_snapshot_marks_the_request_and_records_where_it_lives() -> None:
    async def go() -> None:
        eng = SnapshotFakeEngine()
        runner = runner_over(eng)
        g = await kept_snapshot(eng, runner)
        (s,) = g.samples
        assert list(eng.marks.values()) == ["g/0"] and eng.snaps == {"g/0"}
        assert (s.snapshot_bytes, s.snapshot_weight_version) == (100, "0")
        assert runner.places.of(s) == Slot()
        # Its continuation plans a restore; whatever the restore made visible (nothing,
        # here), the snapshot is freed once the sample finished.
        task = start(runner, s, "call-2")
        assert runner.running["g/0"].restore_planned
        await task
        assert s.output_ids == uninterrupted(300)
        assert eng.snaps == set() and s.snapshot_bytes == 0

    asyncio.run(go())


def test_forget_frees_a_samples_snapshot_and_refresh_clears_an_evicted_ones_figures() -> None:
    async def go() -> None:
        eng = SnapshotFakeEngine()
        runner = runner_over(eng)
        g = await kept_snapshot(eng, runner, n=3)
        assert eng.snaps == {"g/0", "g/1", "g/2"}
        forgotten, evicted, kept = g.samples
        await runner.forget(forgotten)
        assert eng.snaps == {"g/1", "g/2"} and forgotten.snapshot_bytes == 0
        eng.snaps.discard("g/1")  # the store evicted it
        await runner.refresh(g.samples)
        assert evicted.snapshot_bytes == 0 and runner.places.of(evicted) is None
        assert kept.snapshot_bytes == 100 and eng.snaps == {"g/2"}

    asyncio.run(go())


def test_refresh_lists_what_the_engine_holds_once_instead_of_asking_per_sample() -> None:
    async def go() -> None:
        eng = SnapshotFakeEngine(lists=True)
        runner = runner_over(eng)
        g = await kept_snapshot(eng, runner, n=3)
        evicted, kept, also_kept = g.samples
        eng.snaps.discard("g/0")  # the store evicted it
        asked = eng.info_asked
        await runner.refresh(g.samples)
        assert eng.info_asked == asked  # one listing, no question per sample
        assert evicted.snapshot_bytes == 0 and runner.places.of(evicted) is None
        assert kept.snapshot_bytes == 100 and also_kept.snapshot_bytes == 100
        eng.lists = False  # an engine that cannot list is asked per sample
        eng.snaps.discard("g/1")
        await runner.refresh(g.samples)
        assert eng.info_asked == asked + 2 and kept.snapshot_bytes == 0
        assert also_kept.snapshot_bytes == 100

    asyncio.run(go())


def test_a_staleness_restart_starts_over_from_the_prompt_and_is_counted() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.002)
        runner = runner_over(eng)
        g, _, _ = await generating(eng, runner, 300)
        (s,) = g.samples
        await runner.stop(list(runner.running.values()), keep="tokens")
        assert s.output_ids
        eng.version = "2"  # two updates later: more than max_staleness=1 allows
        tally = CallTally()
        task = start(runner, s, "call-2", tally, max_staleness=1)
        assert s.output_ids == [] and s.staleness_restarts == 1
        assert runner.counters.staleness_restarts == 1
        assert tally.notes == ["g/0: restarted from its prompt (max_staleness)"]
        await task
        assert s.output_ids == uninterrupted(300)
        assert [seg.weight_version for seg in s.segments] == ["2"]

    asyncio.run(go())


class GoneOnce(FakeEngine):
    """Its first segment finds the engine gone."""

    gone = True

    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        if self.gone:
            self.gone = False
            raise EngineUnavailable(Slot(), "connection refused")
        return await super().generate(rid, input_ids, sampling_params)


def test_a_segment_whose_engine_went_away_runs_again_and_is_counted() -> None:
    async def go() -> None:
        runner = runner_over(GoneOnce(delay_s=0.001))
        g = group("g", 20)
        (s,) = g.samples
        tally, tasks = start_group(runner, g)
        await asyncio.gather(*tasks)
        assert s.output_ids == uninterrupted(20)
        assert runner.counters.engine_failovers == 1 and runner.counters.engine_errors == 0
        assert len(tally.notes) == 1 and tally.notes[0].endswith("its segment runs again")

    asyncio.run(go())


def test_an_engine_error_leaves_the_sample_as_it_was_and_is_counted() -> None:
    async def go() -> None:
        eng = FakeEngine(delay_s=0.001)
        eng.fail_rids.add("g/0")
        runner = runner_over(eng)
        g = group("g", 20)
        (s,) = g.samples
        tally, tasks = start_group(runner, g)
        await asyncio.gather(*tasks)
        assert (s.output_ids, s.segments, s.status) == ([], [], "partial")
        assert runner.counters.engine_errors == 1 and not runner.running
        assert tally.notes == ["g/0: engine error: injected engine failure"]

    asyncio.run(go())


class Unhealthy(FakeEngine):
    healthy_now = False

    def healthy(self, slot: Slot) -> bool:
        return self.healthy_now


@pytest.mark.parametrize("comes_back", [False, True])
def test_a_segment_with_nowhere_to_run_waits_for_a_healthy_slot(
    comes_back: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segment_runner, "ENGINE_WAIT_S", 1.0)
    monkeypatch.setattr(segment_runner, "HEALTH_POLL_S", 0.01)

    async def go() -> None:
        eng = Unhealthy(delay_s=0.001)
        runner = runner_over(eng)
        g = group("g", 20)
        (s,) = g.samples
        tally, tasks = start_group(runner, g)
        await asyncio.sleep(0.05)
        assert eng.calls == [] and "g/0" in runner.running
        eng.healthy_now = comes_back
        await asyncio.gather(*tasks)
        assert not runner.running
        if comes_back:
            assert s.output_ids == uninterrupted(20) and runner.counters.engine_errors == 0
        else:
            assert eng.calls == [] and s.output_ids == [] and s.status == "partial"
            assert runner.counters.engine_errors == 1
            assert tally.notes == ["g/0: engine unavailable (no healthy engine in 1.0 s)"]

    asyncio.run(go())


def test_engine_without_snapshots_disables_the_policy() -> None:
    runner = runner_over(FakeEngine(), allow_stale=True)
    assert not runner.planner.snapshots_enabled
    assert not runner.planner.usable(sample(100, "0"), "0", [], None)
