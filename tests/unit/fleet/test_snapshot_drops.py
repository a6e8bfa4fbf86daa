"""Snapshot drops an engine missed while out of reach (marked down, or its segment's answer lost
mid-flight) are sent once it answers again, before it serves, and once (`remote.py`'s
`unsent_drops`, resent by `fleet.py`). Fake engine servers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from april_server.engine.base import EngineUnavailable, SegmentCall
from april_server.fleet.engine_wire import KvResp, encoder
from april_server.rules.placement import Slot
from tests.unit.fleet.test_fleet import FakeServers, fleet_over


class DropServers(FakeServers):
    """Also answers snapshot drops (`/kv` op drop), recording which engine got which key."""

    def __init__(self, hosts: list[str]) -> None:
        super().__init__(hosts)
        self.drops: list[tuple[str, str]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        if request.url.path == "/april/v1/engine/kv" and host not in self.gone:
            body = json.loads(request.content)
            assert body["op"] == "drop"
            self.drops.append((host, body["key"]))
            return httpx.Response(200, content=encoder.encode(KvResp()))
        return await super().__call__(request)


def test_a_drop_an_engine_missed_while_out_of_reach_is_sent_when_it_answers_again() -> None:
    """An engine alive but out of reach for a moment (marked down: a lost connection under
    load) missed the drops of samples that left meanwhile, and held their snapshots for good:
    81,920 bytes after the drain of a 10-minute owner chaos run."""

    async def go() -> None:
        servers = DropServers(["a:1", "b:1"])
        fleet = fleet_over(servers, ["a:1", "b:1"])
        await fleet.probe_all()
        b = fleet.members["b:1"]
        servers.gone.add("b:1")
        await fleet.probe_all()
        assert b.state == "down"
        await b.drop_snapshot("s-1/0", Slot("b:1", 0))  # skipped while down (before the fix)
        servers.gone.discard("b:1")
        await b.drop_snapshot("s-2/0", Slot("b:1", 0))  # still marked down: kept too
        assert servers.drops == []
        await fleet.probe_all()  # it answers again: the drops go out before it serves
        assert servers.drops == [("b:1", "s-1/0"), ("b:1", "s-2/0")]
        assert b.state == "healthy" and not b.unsent_drops
        await fleet.probe_all()
        assert len(servers.drops) == 2  # sent once
        await fleet.close()

    asyncio.run(go())


def test_a_segment_lost_mid_flight_has_its_snapshot_dropped_once_the_engine_answers() -> None:
    """The owner lost a segment's answer (its connection broke) while the engine, alive, kept
    whatever snapshot of the sample the segment left: the segment ran again elsewhere, and that
    snapshot was known to nobody (a 10-minute owner chaos run held 61,952 bytes after its
    drain, with engine 0 briefly cut off this way)."""

    async def go() -> None:
        servers = DropServers(["a:1", "b:1"])
        fleet = fleet_over(servers, ["a:1", "b:1"])
        await fleet.probe_all()
        b = fleet.members["b:1"]
        call = SegmentCall("r-1", "s-9/0", [1, 2], {"max_new_tokens": 4}, Slot("b:1", 0))
        segment = asyncio.ensure_future(b.run_segment(call))
        await asyncio.sleep(0.05)
        servers.gone.add("b:1")  # the connection breaks mid-segment
        servers.hold_segments.set()
        with pytest.raises(EngineUnavailable):
            await segment
        assert b.state == "down" and servers.drops == []
        servers.gone.discard("b:1")  # it was alive all along
        await fleet.probe_all()
        assert servers.drops == [("b:1", "s-9/0")] and b.state == "healthy"
        await fleet.close()

    asyncio.run(go())
