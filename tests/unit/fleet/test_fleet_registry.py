"""`FleetEngine`'s members as the registry lists them: an engine back in the registry serves
again, one gone for good is dropped, engines given on the command line serve beside the
registry's. Fake engine servers (httpx.MockTransport, `test_fleet.FakeServers`)."""

from __future__ import annotations

import asyncio

import httpx

from april_server.fleet.fleet import FleetEngine
from tests.unit.fleet.test_fleet import FakeServers


def test_an_engine_back_in_the_registry_serves_again_and_one_gone_is_dropped() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])
        listed = ["http://a:1", "http://b:1"]

        async def discover() -> list[str]:
            return list(listed)

        fleet = FleetEngine(
            discover=discover,
            make_client=lambda: httpx.AsyncClient(transport=httpx.MockTransport(servers)),
        )
        await fleet.probe_all()
        assert {m.name for m in fleet.pool()} == {"a:1", "b:1"}
        listed.remove("http://b:1")
        await fleet.probe_all()
        assert fleet.members["b:1"].state == "down"
        listed.append("http://b:1")  # registered again
        await fleet.probe_all()  # before the fix: skipped for good ("left the registry")
        await fleet.probe_all()
        assert fleet.members["b:1"].state == "healthy"
        listed.remove("http://b:1")
        for _ in range(40):  # it stays gone: dropped from the members
            await fleet.probe_all()
        assert set(fleet.members) == {"a:1"}
        await fleet.close()

    asyncio.run(go())


def test_engines_given_on_the_command_line_serve_beside_the_registry() -> None:
    """Found by review: with `--april-engines` and `--april-smg` together (either or both, as
    `FleetEngine` says), every static engine the registry did not list was marked down as
    having left it, and never probed again: it never served."""

    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])

        async def discover() -> list[str]:
            return ["http://b:1"]

        fleet = FleetEngine(
            ["http://a:1"],
            discover=discover,
            make_client=lambda: httpx.AsyncClient(transport=httpx.MockTransport(servers)),
        )
        for _ in range(2):
            await fleet.probe_all()
        assert {m.name for m in fleet.pool()} == {"a:1", "b:1"}  # before the fix: {"b:1"}
        servers.gone.add("a:1")
        await fleet.probe_all()
        assert fleet.members["a:1"].state == "down"  # its probes still decide
        servers.gone.clear()
        await fleet.probe_all()
        assert fleet.members["a:1"].state == "healthy"
        await fleet.close()

    asyncio.run(go())
