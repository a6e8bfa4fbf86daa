"""The owner's own routes over fake engine servers (httpx.MockTransport,
`test_fleet.FakeServers`): keys and scopes, its buffer with no engine healthy, weight updates
given a version, and a proxied /generate, /flush_cache or /abort_request that ends however
its engine fails (part-way, hung, marked down, answering as the caller left)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from april_server.engine.base import EngineUnavailable
from april_server.fleet.fleet import FleetEngine
from april_server.fleet.gateway import create_owner_app
from april_server.settings.config import AprilConfig
from april_server.wire.auth import AuthPolicy
from tests.unit.fleet.test_fleet import FakeServers, fleet_over

R = "/april/v1"


def owner(servers: FakeServers, auth: AuthPolicy) -> tuple[FleetEngine, Any]:
    fleet = fleet_over(servers, ["a:1", "b:1"])
    return fleet, create_owner_app(fleet, AprilConfig(), auth)


@asynccontextmanager
async def owner_client(
    servers: FakeServers, auth: AuthPolicy | None = None
) -> AsyncIterator[tuple[FleetEngine, Any, httpx.AsyncClient]]:
    """An owner over engines a:1 and b:1, probed, and a client of its app (the fleet is the
    caller's to close: some tests look at it after the client is gone)."""
    fleet, app = owner(servers, auth or AuthPolicy())
    await fleet.probe_all()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://owner") as c:
        yield fleet, app, c


def test_the_user_key_gets_403_on_every_admin_route_of_the_owner() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])
        user = {"authorization": "Bearer user"}
        admin = {"authorization": "Bearer admin"}
        async with owner_client(servers, AuthPolicy("user", "admin")) as (fleet, _, c):
            body = {"model_path": "/m", "weight_version": "9"}
            for path, payload in (
                ("/update_weights_from_disk", body),
                ("/flush_cache", None),
                ("/abort_request", {"abort_all": True}),
                (R + "/abort", {"all": True}),
            ):
                r = await c.post(path, json=payload, headers=user)
                assert r.status_code == 403, (path, r.status_code, r.text)
            assert (await c.delete(R + "/partials/x", headers=user)).status_code == 403
            r = await c.post("/update_weights_from_disk", json=body, headers=admin)
            assert r.status_code == 200, r.text
            assert (await c.get(R + "/stats", headers=user)).status_code == 200
            assert (await c.get(R + "/stats")).status_code == 401
        await fleet.close()

    asyncio.run(go())


def test_the_owner_serves_its_buffer_with_every_engine_down() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])
        servers.hold_segments.set()
        async with owner_client(servers) as (fleet, _, c):
            groups = [
                {"group_id": g, "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
                for g in ("g1", "g2")
            ]
            body = {"groups": groups, "target_groups": 1, "max_inflight_groups": 1}
            r = await c.post(R + "/rollouts", json=body)
            assert r.status_code == 200, r.text
            servers.gone |= {"a:1", "b:1"}
            await fleet.probe_all()  # both refused: no engine healthy
            assert not fleet.pool()
            assert (await c.get(R + "/partials")).status_code == 200
            assert (await c.get(R + "/partials/g2")).status_code == 200
            assert (await c.get(R + "/stats")).status_code == 200
            assert (await c.post(R + "/abort", json={"all": True})).status_code == 200
            assert (await c.get("/metrics")).status_code == 200  # before: 500
            assert (await c.delete(R + "/partials/g2")).status_code == 200
            r = await c.post(R + "/rollouts", json={"groups": [], "target_groups": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine"
        await fleet.close()

    asyncio.run(go())


def test_an_update_without_a_version_gets_one_so_a_restarted_engine_is_not_up_to_date() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])
        async with owner_client(servers) as (fleet, _, c):
            r = await c.post("/update_weights_from_disk", json={"model_path": "/m"})
            assert r.status_code == 200, r.text
        new = fleet.weight_version()
        assert new.startswith("owner-") and set(servers.version.values()) == {new}
        servers.version["b:1"] = "0"  # b restarts with its first weights
        await fleet.probe_all()
        assert fleet.members["b:1"].state == "stale"  # before: "0" == "0", healthy
        await fleet.close()

    asyncio.run(go())


class FailingStream(FakeServers):
    """`/generate` streams two chunks, then the engine goes away mid-answer."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":

            async def chunks() -> Any:
                yield b'data: {"text": "a"}\n\n'
                raise httpx.ReadError("engine gone mid-stream")

            return httpx.Response(200, content=chunks(), headers={"content-type": "text/plain"})
        return await super().__call__(request)


def test_a_generate_stream_that_fails_part_way_leaves_no_request_counted() -> None:
    async def go() -> None:
        servers = FailingStream(["a:1", "b:1"])
        async with owner_client(servers) as (fleet, app, c):
            for _ in range(3):
                try:
                    await c.post("/generate", json={"input_ids": [1], "stream": True})
                except Exception:
                    pass  # the answer broke off, as the engine did
        assert sum(app.state.proxied.values()) == 0  # before: one per failed stream
        await fleet.close()

    asyncio.run(go())


class HangingFlush(FakeServers):
    """`/flush_cache` answers on a:1 and never on b:1 (it hangs, its connection open)."""

    def __init__(self, hosts: list[str]) -> None:
        super().__init__(hosts)
        self.flushed: list[str] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/flush_cache", "/abort_request"):
            host = request.url.netloc.decode()
            if host == "b:1":
                await asyncio.Event().wait()
            self.flushed.append(host)
            return httpx.Response(200, json={"success": True})
        return await super().__call__(request)


def test_a_hung_engine_does_not_hold_the_owners_flush_or_abort(monkeypatch: Any) -> None:
    from april_server.fleet import gateway

    monkeypatch.setattr(gateway, "FANOUT_TIMEOUT_S", 0.2)

    async def go() -> None:
        servers = HangingFlush(["a:1", "b:1"])
        async with owner_client(servers) as (fleet, _, c):
            for path, payload in (("/flush_cache", None), ("/abort_request", {"abort_all": True})):
                # Before: waited on b for good. Now a answers, b is reported, in bounded time.
                r = await asyncio.wait_for(c.post(path, json=payload), 5.0)
                assert r.status_code == 502, r.text
                assert r.json() == {"success": False, "failed": {"b:1": "no answer in 0.2 s"}}
        assert servers.flushed == ["a:1", "a:1"]
        await fleet.close()

    asyncio.run(go())


class HangingGenerate(FakeServers):
    """`/generate` on a:1 never answers (`stream: false`), or sends one chunk and then
    nothing (`stream: true`), its connection open."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            if not json.loads(request.content).get("stream"):
                await asyncio.Event().wait()

            async def chunks() -> Any:
                yield b'data: {"text": "a"}\n\n'
                await asyncio.Event().wait()

            return httpx.Response(200, content=chunks(), headers={"content-type": "text/plain"})
        return await super().__call__(request)


@pytest.mark.parametrize("stream", [False, True])
def test_a_proxied_generate_ends_when_its_engine_is_marked_down(stream: bool) -> None:
    async def go() -> None:
        servers = HangingGenerate(["a:1", "b:1"])
        async with owner_client(servers) as (fleet, app, c):
            call = asyncio.ensure_future(
                c.post("/generate", json={"input_ids": [1], "stream": stream})
            )
            while not app.state.proxied["a:1"]:  # the least loaded, first by name
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the request (and the stream's first chunk) under way
            servers.gone.add("a:1")  # its probe is refused now: marked down at once
            await fleet.probe_all()
            assert fleet.members["a:1"].state == "down"
            # Before: no read timeout, so the owner waited on a:1 for good.
            try:
                r = await asyncio.wait_for(call, 5.0)
            except (EngineUnavailable, httpx.HTTPError):
                assert stream  # the streamed answer broke off after its headers
            else:
                assert not stream and r.status_code == 502, r.text
                assert r.json()["error"]["code"] == "engine_unreachable"
            assert sum(app.state.proxied.values()) == 0
        await fleet.close()

    asyncio.run(go())


def test_the_owners_own_routes_refuse_bad_and_oversize_bodies(monkeypatch: Any) -> None:
    from april_server.http import app as app_module

    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1000)

    async def go() -> None:
        servers = FakeServers(["a:1", "b:1"])
        async with owner_client(servers) as (fleet, app, c):
            # Before: the JSON decode error escaped the route (a 500).
            r = await c.post("/update_weights_from_disk", content=b"{not json")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
            big = {"input_ids": [1] * 1000}
            for path in ("/generate", "/abort_request", "/update_weights_from_disk"):
                r = await c.post(path, json=big)
                assert r.status_code == 413, (path, r.text)
                assert r.json()["error"]["code"] == "body_too_large"
            assert servers.updates == [] and sum(app.state.proxied.values()) == 0
        await fleet.close()

    asyncio.run(go())


class ClosedStream(httpx.AsyncByteStream):
    """A /generate answer that records being closed."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"{}"

    async def aclose(self) -> None:
        self.closed = True


def test_a_generate_answered_as_its_caller_left_is_closed(monkeypatch: Any) -> None:
    from april_server.fleet.remote import RemoteEngine

    answer = ClosedStream()

    class Answering(FakeServers):
        async def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/generate":
                return httpx.Response(200, stream=answer)
            return await super().__call__(request)

    async def answered_then_cancelled(self: RemoteEngine, work: Any, slot: Any) -> Any:
        await work  # the engine's answer is in, and in the same step the caller goes away
        raise asyncio.CancelledError

    async def go() -> None:
        async with owner_client(Answering(["a:1", "b:1"])) as (fleet, app, c):
            monkeypatch.setattr(RemoteEngine, "unless_down", answered_then_cancelled)
            # The route ends cancelled (the owner's key middleware reports no response).
            with pytest.raises((asyncio.CancelledError, RuntimeError)):
                await c.post("/generate", json={"input_ids": [1]})
            for _ in range(10):  # the close runs on its own
                await asyncio.sleep(0)
            assert answer.closed  # before: left open, its connection with it
            assert sum(app.state.proxied.values()) == 0
        await fleet.close()

    asyncio.run(go())
