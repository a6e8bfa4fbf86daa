"""Many engines behind one manager (#13), without SGLang.

- failover in the segment runner: a segment whose engine goes away runs again on a healthy
  one, so a call still returns exactly `target_groups`, with the uninterrupted tokens; with no
  engine left it ends, and the sample keeps what it had;
- `FleetEngine` over fake engine servers (httpx.MockTransport): health states, the dead engine
  leaving the pool and its segments failing at once, weight updates reaching every engine with
  one version, a returning engine brought level by replaying the last update.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from april_client.protocol import GroupSpec, ResumeReq, RolloutReq
from april_server.engine import segment_runner as segments_mod
from april_server.engine.base import EngineUnavailable, SegmentCall, SegmentOutcome
from april_server.fleet.engine_wire import EngineInfo, encoder
from april_server.fleet.fleet import FleetEngine
from april_server.fleet.lanes import LANE_SIZE, Lanes
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.placement import Slot
from april_server.rules.samples import SegmentResult
from tests.unit.fake_engine import FakeEngine
from tests.unit.idle import idle_bodies

NO_EOS = {"ignore_eos": True}


class TwoEngines(FakeEngine):
    """Engines "a" and "b" (one slot each). `die` names an engine that goes away during the
    next segment it is given: it returns nothing, and it leaves the pool."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.001, vocab=256)
        self.down: set[str] = set()
        self.die: set[str] = set()
        self.ran: list[tuple[str, str]] = []  # (sample key, engine) of every attempt

    def slots(self) -> list[Slot]:
        return [Slot("a", 0), Slot("b", 0)]

    def healthy(self, slot: Slot) -> bool:
        return slot.engine not in self.down

    async def run_segment(self, call: SegmentCall) -> SegmentOutcome:
        self.ran.append((call.key, call.slot.engine))
        if call.slot.engine in self.down:
            raise EngineUnavailable(call.slot, "down")
        if call.slot.engine in self.die:
            await asyncio.sleep(0.02)  # it was generating ...
            self.down.add(call.slot.engine)  # ... when it went away
            raise EngineUnavailable(call.slot, "lost mid-segment")
        return await super().run_segment(call)


async def uninterrupted(prompt: list[int], budget: int) -> list[int]:
    ref = FakeEngine(delay_s=0.0, vocab=256)
    out = await ref.generate("ref", prompt, {"max_new_tokens": budget, **NO_EOS})
    return out.output_ids


def spec(gid: str, prompt: list[int], budget: int, n: int = 2) -> GroupSpec:
    return GroupSpec(
        gid, input_ids=prompt, n=n, sampling_params={"max_new_tokens": budget, **NO_EOS}
    )


def test_a_dead_engines_segments_run_again_elsewhere_and_the_quota_holds() -> None:
    async def go() -> None:
        eng = TwoEngines()
        eng.die.add("b")
        mgr = RolloutManager(eng, Durable.open(None))
        groups = [spec(f"g{i}", [i + 3, 9], 40) for i in range(3)]
        # Every group is needed: nothing over-provisioned covers for the dead engine.
        r = await mgr.rollout(RolloutReq(groups=groups, target_groups=3, max_inflight_groups=3))
        assert sorted(g.group_id for g in r.groups) == ["g0", "g1", "g2"]
        assert r.buffered_group_ids == []
        assert {e for _, e in eng.ran} == {"a", "b"}  # both were given work ...
        for g in r.groups:
            want = await uninterrupted(g.samples[0].prompt_ids, 40)
            for s in g.samples:
                assert s.status == "truncated" and s.output_ids == want
                assert [seg.engine for seg in s.segments] == ["a"]  # ... only "a" delivered
        failed_over = [n for n in r.stats.notes if "runs again" in n]
        assert failed_over and mgr.counters.engine_failovers == len(failed_over)
        assert mgr.segments.running == {} and not any(
            x["running_samples"] for x in mgr.segments.planner.by_slot()
        )
        mgr.check_integrity()

    asyncio.run(go())


def test_with_no_engine_left_the_call_ends_and_the_sample_keeps_what_it_had(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(segments_mod, "ENGINE_WAIT_S", 0.3)
    monkeypatch.setattr(segments_mod, "HEALTH_POLL_S", 0.05)

    async def go() -> None:
        eng = TwoEngines()
        mgr = RolloutManager(eng, Durable.open(None))
        # A first call leaves the sample partial with 10 tokens (trigger meets the quota).
        first = RolloutReq(
            groups=[spec("t", [1], 3, n=1), spec("x", [5, 6], 300, n=1)],
            target_groups=1,
            on_quota="tokens",
            max_inflight_groups=2,
        )
        await mgr.rollout(first)
        (held,) = [s for g in idle_bodies(mgr.buffer) for s in g.samples]
        before = list(held.output_ids)
        assert 0 < len(before) < 300
        eng.die |= {"a", "b"}
        (s,) = await mgr.resume(ResumeReq(sample_ids=["x/0"]))
        assert s.status == "partial" and s.output_ids == before  # nothing lost, nothing made up
        assert eng.down == {"a", "b"}
        assert mgr.counters.engine_failovers >= 1 and mgr.counters.engine_errors == 1
        mgr.check_integrity()

    asyncio.run(go())


# ---- FleetEngine over fake engine servers ---------------------------------------------------


class FakeServers:
    """Engine servers as an httpx transport: `version` by host, `gone` hosts refuse."""

    def __init__(self, hosts: list[str]) -> None:
        self.version = dict.fromkeys(hosts, "0")
        self.gone: set[str] = set()
        self.updates: list[tuple[str, dict[str, Any]]] = []
        self.hold_segments = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        if host in self.gone:
            raise httpx.ConnectError("refused", request=request)
        path = request.url.path
        if path == "/april/v1/engine/info":
            info = EngineInfo(512, 256, 1, self.version[host], False, True, "/nowhere")
            return httpx.Response(200, content=encoder.encode(info))
        if path == "/update_weights_from_disk":
            body = json.loads(request.content)
            self.updates.append((host, body))
            self.version[host] = body["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "ok"})
        if path == "/april/v1/engine/segment":
            await self.hold_segments.wait()
            if host in self.gone:
                raise httpx.RemoteProtocolError("disconnected", request=request)
            res = SegmentResult([7], [-0.1], "length", self.version[host])
            return httpx.Response(200, content=encoder.encode(SegmentOutcome(res, Slot())))
        return httpx.Response(404)


def fleet_over(servers: FakeServers, hosts: list[str]) -> FleetEngine:
    def client() -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(servers))

    return FleetEngine([f"http://{h}" for h in hosts], make_client=client, down_after=2)


def test_fleet_health_states_and_a_dead_engine_leaving_the_pool() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])
        fleet = fleet_over(servers, ["a:1", "b:1"])
        await fleet.probe_all()
        assert fleet.ready.is_set() and fleet.weight_version() == "0"
        assert fleet.slots() == [Slot("a:1", 0), Slot("b:1", 0)]
        assert all(fleet.healthy(s) for s in fleet.slots())
        # A segment in flight on b when b goes away ends at once, as unavailable.
        call = SegmentCall("r1", "k", [1, 2], {"max_new_tokens": 1}, Slot("b:1", 0))
        seg = asyncio.ensure_future(fleet.run_segment(call))
        await asyncio.sleep(0.01)
        servers.gone.add("b:1")
        await fleet.probe_all()  # refused: out of the pool at once
        assert not fleet.healthy(Slot("b:1", 0)) and fleet.healthy(Slot("a:1", 0))
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(seg, 5)
        with pytest.raises(EngineUnavailable):  # nothing more is sent there
            await fleet.run_segment(call)
        # It answers again with the fleet's weights: back in the pool.
        servers.gone.clear()
        await fleet.probe_all()
        assert fleet.healthy(Slot("b:1", 0))
        servers.hold_segments.set()
        out = await fleet.run_segment(call)
        assert out.slot == Slot("b:1", 0)  # named by the owner, not "local"
        await fleet.close()

    asyncio.run(go())


def test_weight_updates_reach_every_engine_and_a_returning_one_is_brought_level() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])
        fleet = fleet_over(servers, ["a:1", "b:1"])
        await fleet.probe_all()
        out = await fleet.weights.update_weights({"model_path": "/m", "weight_version": "1"})
        assert out["success"] and out["engines"] == {"a:1": "1", "b:1": "1"}
        assert fleet.weight_version() == "1"
        # b restarts with its old weights: out of the pool until the update is replayed.
        servers.version["b:1"] = "0"
        await fleet.probe_all()
        assert fleet.members["b:1"].state == "stale"
        await asyncio.sleep(0.05)  # the replay runs in the background
        await fleet.probe_all()
        assert fleet.members["b:1"].state == "healthy"
        assert servers.updates[-1] == ("b:1", {"model_path": "/m", "weight_version": "1"})
        # An engine unreachable during an update: the others move on, it stays out.
        servers.gone.add("a:1")
        await fleet.probe_all()
        out = await fleet.weights.update_weights({"model_path": "/m", "weight_version": "2"})
        assert out["success"] and fleet.weight_version() == "2"
        assert fleet.members["a:1"].state == "down"
        servers.gone.clear()
        await fleet.probe_all()  # back with "1": replayed to "2" before it rejoins
        assert fleet.members["a:1"].state == "stale"
        await asyncio.sleep(0.05)
        await fleet.probe_all()
        assert fleet.members["a:1"].state == "healthy" and servers.version["a:1"] == "2"
        await fleet.close()

    asyncio.run(go())


def test_without_an_update_to_replay_a_mismatched_engine_stays_out() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])
        servers.version["b:1"] = "9"
        fleet = fleet_over(servers, ["a:1", "b:1"])
        await fleet.probe_all()
        states = {n: m.state for n, m in fleet.members.items()}
        assert states == {"a:1": "healthy", "b:1": "stale"}  # the first to answer sets it
        assert "update_weights_from_disk" in fleet.members["b:1"].why
        assert [s for s in fleet.slots() if fleet.healthy(s)] == [Slot("a:1", 0)]
        await fleet.close()

    asyncio.run(go())


def test_segments_spread_over_lanes_of_bounded_size() -> None:
    made: list[httpx.AsyncClient] = []

    def client() -> httpx.AsyncClient:
        made.append(httpx.AsyncClient())
        return made[-1]

    lanes = Lanes(client)
    taken = [lanes.take() for _ in range(2 * LANE_SIZE + 1)]
    assert len(made) == 3 and max(lanes.busy) == LANE_SIZE  # no pool holds more
    assert lanes.busy == [LANE_SIZE, LANE_SIZE, 1]
    lanes.give_back(taken[0])
    for _ in range(LANE_SIZE):  # the least busy lane first
        lanes.take()
    assert len(made) == 3 and lanes.busy == [LANE_SIZE] * 3  # room used before a new client
    asyncio.run(lanes.close())
