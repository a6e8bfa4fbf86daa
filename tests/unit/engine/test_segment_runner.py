"""The segment runner (`engine/segment_runner.py`): its admission bound follows the engine's
pool, and a segment that fails unexpectedly leaves its sample free to run again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from april_client.protocol import RolloutReq
from april_server.buffer.store import BufferStore
from april_server.calls.rollout import rollout
from april_server.fleet.wire import encoder
from april_server.rules.inflight import EngineCapacity
from april_server.runtime.manager import RolloutManager
from tests.unit.fake_engine import FakeEngine
from tests.unit.fleet.test_fleet import FakeServers, fleet_over
from tests.unit.group_specs import spec


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
        mgr = RolloutManager(fleet, BufferStore(None))
        one = EngineCapacity(10, 1000)
        await mgr.admission_ready()
        two = mgr.admission.max_samples
        servers.gone.add("b:1")
        await fleet.probe_all()  # b leaves the pool
        await mgr.admission_ready()
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
        mgr = RolloutManager(FakeEngine(delay_s=0.002), BufferStore(tmp_path / "b.sqlite"))
        real = mgr.segments._one_segment
        failures = [1]

        async def malformed_once(*args: Any) -> Any:
            if failures[0]:
                failures[0] -= 1
                raise ValueError("malformed /kv answer")
            return await real(*args)

        mgr.segments._one_segment = malformed_once  # type: ignore[method-assign]
        first = await rollout(mgr, RolloutReq(groups=[spec("a", 20)], target_groups=1))
        assert not first.stats.quota_met and first.buffered_group_ids == ["a"]
        assert "a/0" not in mgr.running  # before the fix: held there for good
        r = await rollout(mgr, RolloutReq(groups=[], target_groups=1))
        assert [g.group_id for g in r.groups] == ["a"]
        assert len(r.groups[0].samples[0].output_ids) == 20
        mgr.check_integrity()

    asyncio.run(go())
