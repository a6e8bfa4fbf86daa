"""An owner's weight-update group over fake engine servers (`fleet/weight_group.py`): rank
offsets, the world size a trainer must use, refusals that keep a broadcast from hanging, the
session holding segments back, and an engine outside the group held out until a push reaches
it (the end-to-end run with real engines and a gloo broadcast is in tests/e2e)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from april_server.engine.base import SegmentCall
from april_server.engine.weight_session import UpdateListener, WeightSession
from april_server.fleet.engine_wire import EngineInfo, encoder
from april_server.fleet.fleet import FleetEngine
from april_server.fleet.weight_group import FleetWeights, rank_offsets
from april_server.rules.placement import Slot
from april_server.wire.errors import ApiError
from tests.unit.fleet.test_fleet import FakeServers, fleet_over


class GroupServers(FakeServers):
    """Fake engines that also join, leave and receive over a weight-update group."""

    def __init__(self, hosts: list[str], tp: dict[str, int] | None = None) -> None:
        super().__init__(hosts)
        self.tp = tp or {}
        self.group: dict[str, str | None] = dict.fromkeys(hosts)
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.netloc.decode(), request.url.path
        if host in self.gone:
            raise httpx.ConnectError("refused", request=request)
        if path == "/april/v1/engine/info":
            tp, group = self.tp.get(host, 1), self.group[host]
            info = EngineInfo(
                512,
                256,
                1,
                self.version[host],
                False,
                True,
                "/nowhere",
                tp_size=tp,
                weight_group=group,
            )
            return httpx.Response(200, content=encoder.encode(info))
        if path.endswith(("_weights_update_group", "_weight_update", "_from_distributed")):
            body = json.loads(request.content)
            self.calls.append((host, path, body))
            if path == "/init_weights_update_group":
                self.group[host] = body.get("group_name", "weight_update_group")
            elif path == "/destroy_weights_update_group":
                self.group[host] = None
            elif path == "/update_weights_from_distributed":
                self.version[host] = body["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "ok"})
        return await super().__call__(request)

    def restart(self, host: str) -> None:
        self.version[host], self.group[host] = "0", None


def owner_session(fleet: FleetEngine, cut: UpdateListener | None = None) -> WeightSession:
    """The owner's weight session as fleet/gateway.py builds it, cutting `cut` (the root's)."""
    session = WeightSession(held_during_session=fleet.weights.session_gate())
    if cut is not None:
        session.cut_by(cut)
    return session


class Cut:
    """Stands in for the segment runner's cut: records the session's cut and continue."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def before_update(self) -> None:
        self.events.append("cut")

    def after_update(self) -> None:
        self.events.append("continue")


def setup(hosts: list[str], tp: dict[str, int] | None = None) -> tuple[GroupServers, FleetEngine]:
    servers = GroupServers(hosts, tp)
    return servers, fleet_over(servers, hosts)


def test_rank_offsets_follow_engine_names_and_tp_sizes() -> None:
    assert rank_offsets([("b:1", 2), ("a:1", 1), ("c:1", 4)], 1) == {"a:1": 1, "b:1": 2, "c:1": 4}


def test_init_gives_each_engine_its_ranks_and_checks_the_world_size() -> None:
    async def go() -> None:
        servers, fleet = setup(["b:1", "a:1"], tp={"b:1": 2})
        await fleet.probe_all()
        weights = FleetWeights(fleet.weights, owner_session(fleet))
        info = fleet.weight_group()
        assert (info.ranks, info.group, info.in_sync) == (3, None, False)
        body = {
            "master_address": "t",
            "master_port": 9,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "g1",
            "backend": "gloo",
        }
        with pytest.raises(ApiError) as bad:
            await weights.init(body)
        assert bad.value.code == "invalid_world_size" and "must be 4" in bad.value.message
        out = await weights.init({**body, "world_size": 4})
        assert out["rank_offsets"] == {"a:1": 1, "b:1": 2}
        sent = {h: b["rank_offset"] for h, p, b in servers.calls if p.startswith("/init")}
        assert sent == {"a:1": 1, "b:1": 2}
        info = fleet.weight_group()
        assert (info.group, info.world_size, info.in_sync, info.behind) == ("g1", 4, True, [])
        await fleet.close()

    asyncio.run(go())


def test_a_push_is_refused_while_an_engine_is_outside_the_group_and_reaches_it_after() -> None:
    async def go() -> None:
        servers, fleet = setup(["a:1", "b:1"])
        await fleet.probe_all()
        weights = FleetWeights(fleet.weights, owner_session(fleet))
        group = {"master_address": "t", "master_port": 9, "world_size": 3, "group_name": "g1"}
        await weights.init(group)
        update = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g1"}
        with pytest.raises(ApiError) as no_session:
            await weights.update(dict(update))
        assert no_session.value.code == "no_weight_session"
        await weights.begin({})
        out = await weights.update(dict(update))
        await weights.end({})
        pushed = out["weight_version"]
        assert pushed.startswith("owner-") and out["engines"] == {"a:1": pushed, "b:1": pushed}
        # b restarts with its first weights and no group: out of the pool, listed as behind,
        # and a broadcast to the old group (which would hang on it) is refused.
        servers.restart("b:1")
        await fleet.probe_all()
        assert fleet.members["b:1"].state == "stale"
        assert "weight-update group" in fleet.members["b:1"].why
        await asyncio.sleep(0.05)  # nothing replays a broadcast
        await fleet.probe_all()
        assert fleet.members["b:1"].state == "stale"
        assert [s for s in fleet.slots() if fleet.healthy(s)] == [Slot("a:1", 0)]
        info = fleet.weight_group()
        assert info.behind == ["b:1"] and not info.in_sync
        with pytest.raises(ApiError) as behind:
            await weights.begin({})
        assert behind.value.code == "weight_group_behind"
        # The trainer builds a new group over both and pushes: b serves again.
        await weights.destroy({"group_name": "g1"})
        await weights.init({**group, "group_name": "g2"})
        await weights.begin({})
        out = await weights.update({**update, "group_name": "g2", "weight_version": "2"})
        await weights.end({})
        assert out["engines"] == {"a:1": "2", "b:1": "2"}
        assert fleet.members["b:1"].state == "healthy" and fleet.weight_group().in_sync
        await fleet.close()

    asyncio.run(go())


def test_the_session_holds_new_segments_until_its_end_or_its_time_limit() -> None:
    async def go() -> None:
        servers, fleet = setup(["a:1"])
        servers.hold_segments.set()
        await fleet.probe_all()
        cut = Cut()
        weights = FleetWeights(fleet.weights, owner_session(fleet, cut))
        await weights.init({"master_address": "t", "master_port": 9, "world_size": 2})
        await weights.begin({})
        call = SegmentCall("r1", "k", [1, 2], {"max_new_tokens": 1}, Slot("a:1", 0))
        seg = asyncio.ensure_future(fleet.run_segment(call))
        await asyncio.sleep(0.05)
        assert not seg.done() and cut.events == ["cut"]  # held for the session
        await weights.end({})
        assert (await asyncio.wait_for(seg, 5)).result.output_ids == [7]
        assert cut.events == ["cut", "continue"]
        # A trainer that never ends its session does not wedge the owner.
        weights.session.limit_s = 0.05
        await weights.begin({})
        seg = asyncio.ensure_future(fleet.run_segment(call))
        assert (await asyncio.wait_for(seg, 5)).result.output_ids == [7]
        assert cut.events == ["cut", "continue", "cut", "continue"]
        await fleet.close()

    asyncio.run(go())


def test_a_begin_refused_by_one_engine_holds_nothing() -> None:
    """Found by review: the owner held every segment and cut the running ones before its
    begin fanned out, and a begin that one engine refused left all of it in place (and the
    engines that began inside SGLang's session) until the 300 s watchdog, since a trainer
    whose begin failed never sends the end. Now it lets go at once, as one server does."""

    class RefusingBegin(GroupServers):
        async def __call__(self, request: httpx.Request) -> httpx.Response:
            host, path = request.url.netloc.decode(), request.url.path
            if host == "b:1" and path == "/begin_weight_update":
                return httpx.Response(500, json={"success": False, "message": "refused"})
            return await super().__call__(request)

    async def go() -> None:
        hosts = ["a:1", "b:1"]
        servers = RefusingBegin(hosts)
        servers.hold_segments.set()  # the fake engines answer segments at once
        fleet = fleet_over(servers, hosts)
        await fleet.probe_all()
        cut = Cut()
        weights = FleetWeights(fleet.weights, owner_session(fleet, cut))
        await weights.init({"master_address": "t", "master_port": 9, "world_size": 3})
        with pytest.raises(ApiError) as exc:
            await weights.begin({})
        assert exc.value.status == 502 and "b:1" in exc.value.message
        assert not fleet.weights.session_open and cut.events == ["cut", "continue"]
        ended = [h for h, p, _ in servers.calls if p == "/end_weight_update"]
        assert ended == ["a:1"]  # the engine that began leaves its session again
        call = SegmentCall("r1", "k", [1, 2], {"max_new_tokens": 1}, Slot("a:1", 0))
        seg = await asyncio.wait_for(fleet.run_segment(call), 5)  # not held
        assert seg.result.output_ids == [7]
        await fleet.close()

    asyncio.run(go())
