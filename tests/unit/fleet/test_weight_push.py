"""A weight push over fake engine servers: a segment it holds still stops at once when aborted,
an engine seen dead during it stays down, one that hangs once marked down does not hold it, a
session's hold outlasts a push inside it; and the push as a part of its own, over no engines."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from april_server.engine.base import SegmentCall
from april_server.fleet.fleet import FleetEngine
from april_server.fleet.weight_push import WeightPush
from april_server.rules.placement import Slot
from april_server.wire.errors import ApiError
from tests.unit.fleet.test_fleet import FakeServers, fleet_over


def test_a_segment_held_by_a_weight_update_stops_at_once_when_aborted() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1"])
        fleet = fleet_over(servers, ["a:1"])
        await fleet.probe_all()
        fleet.weights.hold_segments()  # a weight update is reaching the engines
        call = SegmentCall("r1", "k", [1, 2], {"max_new_tokens": 5}, Slot("a:1", 0))
        seg = asyncio.ensure_future(fleet.run_segment(call))
        await asyncio.sleep(0.05)
        fleet.abort("r1")  # before the fix: waited for the whole update
        out = await asyncio.wait_for(seg, 2.0)
        assert out.result.finish_reason == "abort" and out.result.output_ids == []
        fleet.weights.release_segments()
        await fleet.close()

    asyncio.run(go())


def test_an_engine_seen_dead_during_a_push_is_not_turned_stale() -> None:
    """Found by review: a probe marked an engine down while a push was in flight, its update
    failed, and the push's end marked it `stale`, which clears `down`: a dead engine counted
    as a live member (of the weight group too) until the next probe."""

    class DiesMidPush(FakeServers):
        fleet: FleetEngine

        async def __call__(self, request: httpx.Request) -> httpx.Response:
            host = request.url.netloc.decode()
            if host == "b:1" and request.url.path == "/update_weights_from_disk":
                self.gone.add(host)
                await self.fleet.probe_all()  # the probe loop sees it die meanwhile
                raise httpx.ConnectError("refused", request=request)
            return await super().__call__(request)

    async def go() -> None:
        servers = DiesMidPush(["a:1", "b:1"])
        fleet = servers.fleet = fleet_over(servers, ["a:1", "b:1"])
        await fleet.probe_all()
        out = await fleet.weights.update_weights(
            {"model_path": "/m", "weight_version": "1"}, "/update_weights_from_disk"
        )
        assert not out["success"]
        assert fleet.members["b:1"].state == "down"  # before the fix: "stale"
        assert fleet.members["a:1"].state == "healthy" and fleet.weight_version() == "1"
        await fleet.close()

    asyncio.run(go())


def test_a_push_does_not_wait_on_an_engine_marked_down_while_it_hangs() -> None:
    """Found by review: a segment's request ends when a probe marks its engine down, a weight
    push's did not: an engine that hangs without resetting its connections (a lost host, a
    partition) held the push, and with it every engine's segments, for the 30-minute read
    timeout. Now the push fails over that engine as soon as it is marked down."""

    class Hangs(FakeServers):
        async def __call__(self, request: httpx.Request) -> httpx.Response:
            host = request.url.netloc.decode()
            if host == "b:1" and request.url.path == "/update_weights_from_disk":
                await asyncio.Event().wait()  # never answers, never resets
            return await super().__call__(request)

    async def go() -> None:
        servers = Hangs(["a:1", "b:1"])
        fleet = fleet_over(servers, ["a:1", "b:1"])
        await fleet.probe_all()
        push = asyncio.ensure_future(
            fleet.weights.update_weights(
                {"model_path": "/m", "weight_version": "1"}, "/update_weights_from_disk"
            )
        )
        await asyncio.sleep(0.05)
        assert not push.done()
        servers.gone.add("b:1")
        for _ in range(2):  # the probe loop finds it out of reach
            await fleet.probe_all()
        out = await asyncio.wait_for(push, 5)  # before the fix: waits 30 min
        assert not out["success"] and "b:1" in out["message"]
        assert fleet.members["b:1"].state == "down" and fleet.weight_version() == "1"
        await fleet.close()

    asyncio.run(go())


def test_a_session_keeps_new_segments_held_through_a_push_until_its_end() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1"])
        fleet = fleet_over(servers, ["a:1"])
        await fleet.probe_all()
        push = fleet.weights
        push.hold_segments(session=True)
        out = await push.update_weights({"model_path": "/m", "weight_version": "1"})
        assert out["success"] and push.held()  # the push lets go; the session holds on
        push.release_segments(session=True)
        assert not push.held() and not push.session_open and fleet.weight_version() == "1"
        await fleet.close()

    asyncio.run(go())


def test_a_weight_push_over_no_engines_refuses_and_holds_nothing() -> None:
    async def go() -> None:
        push = WeightPush({})
        assert (push.group().ranks, push.group().weight_version) == (0, "")
        with pytest.raises(ApiError) as exc:
            await push.update_weights({"model_path": "/m", "weight_version": "1"})
        assert exc.value.code == "no_engine" and push.version is None
        assert not push.held() and not push.updating()

    asyncio.run(go())
