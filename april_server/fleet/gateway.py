"""The owner's HTTP server: `/april/v1` over a `FleetEngine`, and the SGLang routes a trainer or
`april-bench` calls, spread over the engines. It runs no model (`april-server --april-engines`).

SGLang routes, as the owner answers them:
- `POST /update_weights_from_disk`: every engine, then one version everywhere (the fleet's
  `weights`: `weight_push.py`);
- `POST /init_weights_update_group`, `/begin_weight_update`, `/update_weights_from_distributed`,
  `/end_weight_update`, `/destroy_weights_update_group`: one group over every engine, so a
  trainer broadcasts once (`weight_group.py`);
- `POST /generate`: passed through to the healthy engine with the fewest such requests
  (plain generation, e.g. a trainer-side baseline; streamed answers stream);
- `POST /abort_request`, `POST /flush_cache`: every healthy engine;
- `GET /v1/loads`: every healthy engine's loads, one list;
- `GET /health`: 200 while some engine is in the pool; `GET /model_info`, `/server_info`,
  `/v1/models`, `/health_generate`: from one healthy engine (`/server_info` adds `engines`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from april_server.door.engine import preload_sampling_params
from april_server.engine.base import EngineUnavailable
from april_server.engine.weight_session import WeightSession
from april_server.fleet.fleet import FleetEngine
from april_server.fleet.remote import CONNECT_TIMEOUT_S, RemoteEngine
from april_server.fleet.weight_group import FleetWeights
from april_server.http.app import create_router, error_response, extend_app, read_bounded
from april_server.http.streaming import StreamThen
from april_server.root.holder import RootHolder
from april_server.root.manager import RolloutManager
from april_server.rules.placement import Slot
from april_server.runtime.snapshot_sweep import SWEEP_INTERVAL_S
from april_server.settings.config import AprilConfig
from april_server.wire.auth import AuthPolicy
from april_server.wire.errors import ApiError

logger = logging.getLogger(__name__)
READY_WAIT_S = 600.0  # how long start-up waits for a first engine before serving 503s
# `/abort_request` and `/flush_cache` go to every engine, and SGLang answers both at once (a
# flush that finds requests running refuses, it does not wait). An engine that hangs without
# closing its connection would hold the answer for every engine: after this long it is
# reported as failed, beside the engines that did answer.
FANOUT_TIMEOUT_S = 60.0
# The owner's routes that SGLang marks ADMIN_OPTIONAL on an engine server (0.5.23).
ADMIN_ROUTES = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/flush_cache",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
    }
)


def create_owner_app(fleet: FleetEngine, config: AprilConfig, auth: AuthPolicy) -> FastAPI:
    # One weight session for the owner's routes, as on one server: a push cuts the segments
    # the root runs; a begin..end session also holds every new segment of the fleet.
    weights = WeightSession(held_during_session=fleet.weights.session_gate())
    root = RootHolder(config, lambda: fleet, weights, sweep_default_s=SWEEP_INTERVAL_S)
    proxied: Counter[str] = Counter()  # /generate requests in flight, by engine

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # SGLang's sampling-params check is imported on first use: now, not on the event loop
        # under the first rollout (0.7 s measured).
        await asyncio.to_thread(preload_sampling_params)
        await fleet.start()
        try:
            await asyncio.wait_for(fleet.ready.wait(), READY_WAIT_S)
            root.get()  # after the first engine answered: sizes and version are known
        except TimeoutError:
            logger.error("april: no engine answered in %.0f s; serving 503s", READY_WAIT_S)
        yield
        built = root.peek()
        if built is not None:
            await built.close()
        await fleet.close()

    def get_manager() -> RolloutManager:
        # The buffer lives here: reading it, deleting from it and aborting need no engine;
        # the root is built once the first engine said what the fleet serves.
        if not fleet.ready.is_set():
            raise ApiError(503, "no_engine", "no engine server has answered yet")
        return root.get()

    def engine_ready() -> None:
        """For the work that needs an engine (generation)."""
        if not fleet.pool():
            raise ApiError(503, "no_engine", "no engine server is healthy")

    app = FastAPI(title="april-server (owner)", lifespan=lifespan)
    app.state.proxied = proxied  # /generate requests in flight by engine (tests read it)
    app.include_router(create_router(get_manager, config, auth, engine_ready))
    extend_app(app)

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable[[Request], Any]) -> Response:
        # SGLang's own middleware is not here: the same rule, the owner's routes included.
        # Routes that act on every engine need the admin key when there is one, as SGLang's
        # ADMIN_OPTIONAL routes do on an engine server (else the user key would get through).
        path = request.url.path
        header = request.headers.get("authorization")
        try:
            if path in ADMIN_ROUTES:
                auth.require_admin(header, path)
            elif path not in ("/health", "/metrics"):
                auth.require_user(header)
        except ApiError as exc:
            return error_response(exc.status, exc.code, exc.message)
        response: Response = await call_next(request)
        return response

    def one() -> RemoteEngine:
        pool = fleet.pool()
        if not pool:
            raise ApiError(503, "no_engine", "no engine server is healthy")
        return min(pool, key=lambda m: (proxied[m.name], m.name))

    def answer(resp: httpx.Response) -> Response:
        kind = resp.headers.get("content-type", "application/json")
        return Response(resp.content, status_code=resp.status_code, media_type=kind)

    async def forward(m: RemoteEngine, method: str, path: str, body: bytes = b"") -> Response:
        resp = await fleet.http.request(
            method,
            m.url + path,
            content=body or None,
            headers={**m.headers, "content-type": "application/json"},
            timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None),
        )
        return answer(resp)

    async def each(path: str, body: bytes) -> Response:
        pool = fleet.pool()
        resps = await asyncio.gather(
            *(asyncio.wait_for(forward(m, "POST", path, body), FANOUT_TIMEOUT_S) for m in pool),
            return_exceptions=True,
        )
        bad = {
            m.name: f"no answer in {FANOUT_TIMEOUT_S:g} s"
            if isinstance(r, TimeoutError)
            else str(r)
            for m, r in zip(pool, resps, strict=True)
            if isinstance(r, Exception)
        }
        bad |= {
            m.name: f"HTTP {r.status_code}"
            for m, r in zip(pool, resps, strict=True)
            if isinstance(r, Response) and r.status_code >= 400
        }
        if bad:
            return JSONResponse({"success": False, "failed": bad}, status_code=502)
        return JSONResponse({"success": True, "engines": [m.name for m in pool]})

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapper(request: Request) -> Response:
            try:
                return await fn(request)  # type: ignore[no-any-return]
            except ApiError as exc:
                return error_response(exc.status, exc.code, exc.message)
            except (httpx.HTTPError, EngineUnavailable) as exc:
                return error_response(502, "engine_unreachable", str(exc))

        wrapper.__name__ = fn.__name__
        return wrapper

    @app.get("/health")
    async def health() -> Response:
        if fleet.pool():
            return Response(status_code=200)
        return error_response(503, "no_engine", "no engine server is healthy")

    @app.post("/update_weights_from_disk")
    @guarded
    async def update_weights(request: Request) -> Response:
        body = await json_body(request)
        if "model_path" not in body:
            raise ApiError(
                400, "invalid_request", "send {'model_path': ..., 'weight_version': ...}"
            )
        if body.get("weight_version") is None:
            # Every update gets a version of its own: without one, an engine restarted
            # with its first weights would report the same version and rejoin as up to date.
            body["weight_version"] = f"owner-{uuid.uuid4().hex[:12]}"
        # As on an engine server: the segments this owner runs are cut at the version boundary,
        # so the engines' updates need not wait for stragglers, and go on under the new weights
        # afterwards. A caller that aborts everything gets that.
        async with weights.push(abort_all=bool(body.get("abort_all_requests", False))):
            out = await fleet.weights.update_weights(body)
        return JSONResponse(out, status_code=200 if out["success"] else 502)

    group = FleetWeights(fleet.weights, weights)

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await read_bounded(request))
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_request", "send a JSON object")
        return body

    # A broadcast over a weight-update group, through the owner (`weight_group.py`).
    for path, act in (
        ("/init_weights_update_group", group.init),
        ("/destroy_weights_update_group", group.destroy),
        ("/begin_weight_update", group.begin),
        ("/update_weights_from_distributed", group.update),
        ("/end_weight_update", group.end),
    ):

        async def route(request: Request, act: Any = act) -> Response:
            out = await act(await json_body(request))
            return JSONResponse(out, status_code=200 if out.get("success", True) else 502)

        route.__name__ = path.strip("/")
        app.post(path)(guarded(route))

    @app.post("/generate")
    @guarded
    async def generate(request: Request) -> Response:
        m = one()
        req = fleet.http.build_request(
            "POST",
            m.url + "/generate",
            content=await read_bounded(request),
            headers={**m.headers, "content-type": "application/json"},
            timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None),
        )
        # No read timeout: a generation may rightly run long. A hung engine (its connection
        # open, no answer) ends the request instead once the owner marks it down.
        slot = Slot(m.name, 0)
        proxied[m.name] += 1
        sending = asyncio.ensure_future(fleet.http.send(req, stream=True))
        try:
            resp = await m.unless_down(sending, slot)
        except BaseException:
            proxied[m.name] -= 1
            if sending.done() and not sending.cancelled() and sending.exception() is None:
                # Answered in the step its caller went away: nobody reads it, so close it
                # (its connection, and the engine's generation, would otherwise stay open).
                asyncio.ensure_future(sending.result().aclose())
            raise

        async def done() -> None:  # once, however the stream ends (it may fail part-way)
            proxied[m.name] -= 1
            await resp.aclose()

        return StreamThen(
            m.stream_unless_down(resp.aiter_raw(), slot),
            done,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type"),
        )

    @app.post("/abort_request")
    @guarded
    async def abort_request(request: Request) -> Response:
        return await each("/abort_request", await read_bounded(request))

    @app.post("/flush_cache")
    @guarded
    async def flush_cache(request: Request) -> Response:
        return await each("/flush_cache", b"")

    @app.get("/v1/loads")
    @guarded
    async def loads(request: Request) -> Response:
        pool = fleet.pool()
        resps = await asyncio.gather(
            *(fleet.http.get(m.url + "/v1/loads", headers=m.headers) for m in pool)
        )
        out: list[Any] = []
        for m, r in zip(pool, resps, strict=True):
            for x in r.json().get("loads", []):
                out.append({**x, "engine": m.name})
        return JSONResponse({"loads": out})

    @app.get("/server_info")
    @app.get("/get_server_info")
    @guarded
    async def server_info(request: Request) -> Response:
        m = one()
        r = await fleet.http.get(m.url + request.url.path, headers=m.headers)
        info = r.json()
        info["engines"] = [x.describe() for x in fleet.members.values()]
        info["weight_version"] = fleet.weight_version()
        return JSONResponse(info, status_code=r.status_code)

    for path in ("/model_info", "/get_model_info", "/v1/models", "/health_generate"):

        async def passthrough(request: Request) -> Response:
            return await forward(one(), "GET", request.url.path)

        app.add_api_route(path, guarded(passthrough), methods=["GET"])

    return app


def serve(
    fleet: FleetEngine,
    config: AprilConfig,
    auth: AuthPolicy,
    host: str,
    port: int,
    log_level: str = "info",
) -> None:
    import uvicorn

    app = create_owner_app(fleet, config, auth)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=75)
