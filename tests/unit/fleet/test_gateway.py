"""Regressions of the owner/fleet review defects (issue #23), over fake engine servers
(httpx.MockTransport, `test_fleet.FakeServers`): each test failed on the code before its fix."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from april_server.buffer.store import BufferStore
from april_server.engine.base import EngineUnavailable, SegmentCall
from april_server.fleet.fleet import FleetEngine
from april_server.fleet.gateway import create_owner_app
from april_server.fleet.wire import KvResp, encoder
from april_server.rules.inflight import EngineCapacity
from april_server.rules.placement import Slot
from april_server.runtime.manager import RolloutManager
from april_server.settings.config import AprilConfig
from april_server.wire.auth import AuthPolicy
from tests.unit.fleet.test_fleet import FakeServers, fleet_over

R = "/april/v1"


class FiguredServers(FakeServers):
    """Also answers `/figures` with a capacity per engine."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/april/v1/engine/figures":
            return httpx.Response(200, content=encoder.encode({"capacity": [10, 1000]}))
        return await super().__call__(request)


# ---- 4: an engine that leaves smg's registry and comes back serves again ---------------------


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


# ---- 6: admission follows the healthy pool --------------------------------------------------


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


# ---- 7: an abort never waits for a weight update ----------------------------------------------


def test_a_segment_held_by_a_weight_update_stops_at_once_when_aborted() -> None:
    async def go() -> None:
        servers = FakeServers(["a:1"])
        fleet = fleet_over(servers, ["a:1"])
        await fleet.probe_all()
        fleet._open.clear()  # a weight update is reaching the engines
        call = SegmentCall("r1", "k", [1, 2], {"max_new_tokens": 5}, Slot("a:1", 0))
        seg = asyncio.ensure_future(fleet.run_segment(call))
        await asyncio.sleep(0.05)
        fleet.abort("r1")  # before the fix: waited for the whole update
        out = await asyncio.wait_for(seg, 2.0)
        assert out.result.finish_reason == "abort" and out.result.output_ids == []
        fleet._open.set()
        await fleet.close()

    asyncio.run(go())


# ---- 5 and 9: the owner's keys, and its buffer with no engine healthy --------------------------


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


# ---- suspected: a weight update without a version; a /generate stream failing part-way --------


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


# ---- found by `make chaos` (owner, 10 min): drops an engine missed for a moment ------------


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


# ---- review of 2026-12-06: an engine that dies during a push stays down ----------------------


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
        out = await fleet.update_weights(
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
            fleet.update_weights(
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


# ---- a proxied /generate on an engine that hangs with its connection open ------------------


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
