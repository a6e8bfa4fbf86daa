"""The routes over a fake engine, through httpx's ASGI transport (no network, no SGLang)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI

from april_client.protocol import RejectReq, RolloutReq
from april_server.http import app as app_module
from april_server.http.app import create_router
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.settings.config import AprilConfig
from april_server.wire.auth import AuthPolicy
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import FakeEngine
from tests.unit.idle import idle_bodies

R = "/april/v1"


def app_and_manager(delay_s: float = 0.001) -> tuple[FastAPI, RolloutManager]:
    mgr = RolloutManager(FakeEngine(delay_s=delay_s), Durable.open(None))
    app = FastAPI()
    app.include_router(create_router(lambda: mgr))
    return app, mgr


def group(gid: str, budgets: list[int]) -> dict[str, Any]:
    return {
        "group_id": gid,
        "input_ids": [1, 2],
        "n": len(budgets),
        "sampling_params": {"ignore_eos": True},
        "member_params": [{"max_new_tokens": b} for b in budgets],
    }


async def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_errors_use_the_contract_body() -> None:
    async def go() -> None:
        app, _ = app_and_manager()
        async with await _client(app) as c:
            for body, status, code in [
                (b"{", 400, "malformed_json"),
                (b'{"groups": 3}', 422, "invalid_schema"),
                (b'{"target_groups": true}', 422, "invalid_schema"),
                (b'{"groups": [], "target_groups": 1}', 400, "invalid_target"),
            ]:
                r = await c.post(R + "/rollouts", content=body)
                assert r.status_code == status, r.text
                assert r.json()["error"]["code"] == code

    asyncio.run(go())


def test_stream_events_then_done() -> None:
    async def go() -> None:
        app, mgr = app_and_manager()
        async with await _client(app) as c:
            body = {"groups": [group("a", [3]), group("b", [400])], "stream": True}
            async with c.stream("POST", R + "/rollouts", json=body) as r:
                assert r.status_code == 200
                lines = [json.loads(x) async for x in r.aiter_lines() if x]
        assert [e["event"] for e in lines] == ["group_finished", "done"]
        assert lines[0]["group"]["group_id"] == "a"
        assert lines[0]["batch_id"] == lines[1]["batch_id"] != ""
        assert lines[1]["buffered_group_ids"] == ["b"]
        assert [g.group_id for g in idle_bodies(mgr.buffer)] == ["b"]

    asyncio.run(go())


def test_stream_validation_error_is_a_plain_4xx() -> None:
    async def go() -> None:
        app, _ = app_and_manager()
        async with await _client(app) as c:
            r = await c.post(R + "/rollouts", json={"groups": [], "stream": True})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_target"

    asyncio.run(go())


def test_reject_uncounts_a_finished_group() -> None:
    # NOTE: httpx's ASGI transport buffers whole responses, so the live stream is driven
    # through the manager's event queue here; tests/e2e covers it over real HTTP.
    async def go() -> None:
        _, mgr = app_and_manager(delay_s=0.002)
        req = msgspec.convert(
            {
                "groups": [group("a", [2]), group("b", [60]), group("c", [400])],
                "stream": True,
                "reject_grace_s": 5.0,
            },
            RolloutReq,
        )
        events: asyncio.Queue[Any] = asyncio.Queue()
        task = asyncio.ensure_future(mgr.rollout(req, events))
        first = await events.get()
        assert first.group.group_id == "a"
        (call,) = mgr.calls.values()
        call.reject(RejectReq(group_ids=["a"]))
        resp = await task
        assert [g.group_id for g in resp.groups] == ["b"]
        assert resp.stats.num_rejected_groups == 1
        assert resp.buffered_group_ids == ["c"]
        assert "a" not in mgr.buffer.claimed  # rejected groups are discarded, not buffered
        with pytest.raises(ApiError):
            call.reject(RejectReq(group_ids=["b"]))  # too late: the call is over

    asyncio.run(go())


def test_partials_get_delete_and_stats() -> None:
    async def go() -> None:
        app, mgr = app_and_manager()
        async with await _client(app) as c:
            r = await c.post(R + "/rollouts", json={"groups": [group("a", [2]), group("b", [300])]})
            assert r.status_code == 200
            assert [g["group_id"] for g in (await c.get(R + "/partials")).json()["groups"]] == ["b"]
            assert (await c.get(R + "/partials/b")).json()["samples"][0]["status"] == "partial"
            stats = (await c.get(R + "/stats")).json()
            assert stats["buffered_groups"] == 1 and stats["rollout_calls"] == 1
            assert (await c.delete(R + "/partials/b")).json() == {"group_id": "b", "deleted": True}
            assert (await c.delete(R + "/partials/b")).status_code == 404
        mgr.check_integrity()

    asyncio.run(go())


def test_metrics_are_prometheus_text_of_the_stats() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async def go() -> None:
        app, _ = app_and_manager()
        async with await _client(app) as c:
            body = {"groups": [group("a", [2]), group("b", [300])], "target_groups": 1}
            assert (await c.post(R + "/rollouts", json=body)).status_code == 200
            stats = (await c.get(R + "/stats")).json()
            r = await c.get(R + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = {s.name: s for fam in text_string_to_metric_families(r.text) for s in fam.samples}
        assert samples["april_rollout_calls_total"].value == stats["rollout_calls"] == 1
        assert samples["april_output_tokens_total"].value == stats["output_tokens"] > 0
        assert samples["april_buffered_groups"].value == stats["buffered_groups"] == 1
        assert samples["april_kv_snapshots_enabled"].value == 0
        assert samples["april_weight_info"].labels == {"version": stats["weight_version"]}

    asyncio.run(go())


def test_root_metrics_route_is_open_and_april_route_needs_the_key() -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(), Durable.open(None))
        app = FastAPI()
        app.include_router(create_router(lambda: mgr, auth=AuthPolicy("user-k", None)))
        async with await _client(app) as c:
            # Prometheus scrapes /metrics without a key, as SGLang's own route allows.
            r = await c.get("/metrics")
            assert r.status_code == 200 and "april_rollout_calls_total 0.0" in r.text
            assert (await c.get(R + "/metrics")).status_code == 401
            r = await c.get(R + "/metrics", headers={"Authorization": "Bearer user-k"})
            assert r.status_code == 200 and "april_buffered_groups" in r.text

    asyncio.run(go())


def test_api_key_and_admin_scope() -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(), Durable.open(None))
        app = FastAPI()
        app.include_router(create_router(lambda: mgr, auth=AuthPolicy("user-k", "admin-k")))
        user = {"Authorization": "Bearer user-k"}
        admin = {"Authorization": "Bearer admin-k"}
        body = {"groups": [group("a", [2]), group("b", [50])]}
        async with await _client(app) as c:
            r = await c.post(R + "/rollouts", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            r = await c.post(R + "/rollouts", json=body, headers={"Authorization": "Bearer x"})
            assert r.status_code == 401
            assert (await c.post(R + "/rollouts", json=body, headers=user)).status_code == 200
            assert (await c.get(R + "/partials", headers=admin)).status_code == 200
            r = await c.post(R + "/abort", json={"all": True}, headers=user)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
            assert (
                await c.post(R + "/abort", json={"all": True}, headers=admin)
            ).status_code == 200
            assert (await c.post(R + "/abort", json={"group_ids": ["b"]}, headers=user)).is_success
            assert (await c.delete(R + "/partials/b", headers=user)).status_code == 403
            assert (await c.delete(R + "/partials/b", headers=admin)).status_code == 200

    asyncio.run(go())


def test_limits_are_clear_4xx() -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(), Durable.open(None))
        app = FastAPI()
        cfg = AprilConfig(max_groups_per_call=2, max_n=4, max_samples_per_call=6)
        app.include_router(create_router(lambda: mgr, config=cfg))
        async with await _client(app) as c:
            many = {"groups": [group(f"g{i}", [1]) for i in range(3)]}
            r = await c.post(R + "/rollouts", json=many)
            assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_groups"
            wide = {"groups": [group("w", [1] * 5)]}
            r = await c.post(R + "/rollouts", json=wide)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_n"
            # A negative n cannot lower the sum below (nor reach a group build): a 400 first.
            sneaky = {"groups": [group("h1", [1] * 4), {**group("h2", [1]), "n": -100}]}
            r = await c.post(R + "/rollouts", json=sneaky)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_n"
            # Each group within max_n, but 4 + 4 samples in all: more than 6.
            heavy = {"groups": [group("h1", [1] * 4), group("h2", [1] * 4)]}
            for path in ("/rollouts", "/groups"):
                r = await c.post(R + path, json=heavy)
                assert r.status_code == 413, r.text
                assert r.json()["error"]["code"] == "too_many_samples"
            assert mgr.buffer.claimed == {}

    asyncio.run(go())


def test_an_oversize_body_is_refused_before_it_is_read_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1000)

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(), Durable.open(None))
        app = FastAPI()
        app.include_router(create_router(lambda: mgr))
        async with await _client(app) as c:
            big = {"groups": [group(f"g{i}", [1]) for i in range(40)]}  # > 1000 bytes
            r = await c.post(R + "/rollouts", json=big)  # with a Content-Length
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

            async def chunked() -> Any:  # no Content-Length: counted as it arrives
                for _ in range(20):
                    yield b" " * 100

            r = await c.post(R + "/rollouts", content=chunked())
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
            assert mgr.buffer.claimed == {}

        # The reader stops at the first chunk past the bound: the rest is never pulled.
        pulled = 0

        class Chunks:
            headers: dict[str, str] = {}

            async def stream(self) -> Any:
                nonlocal pulled
                for _ in range(1000):
                    pulled += 1
                    yield b"x" * 300

        with pytest.raises(ApiError):
            await app_module.read_bounded(Chunks())  # type: ignore[arg-type]
        assert pulled == 4  # 4 x 300 > 1000

        # A declared Content-Length over the bound is refused before anything is pulled.
        pulled = 0
        declared = Chunks()
        declared.headers = {"content-length": "1001"}
        with pytest.raises(ApiError):
            await app_module.read_bounded(declared)  # type: ignore[arg-type]
        assert pulled == 0

    asyncio.run(go())
