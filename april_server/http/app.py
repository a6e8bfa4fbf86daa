"""The `/april/v1` routes. Each handler decodes, calls its operation (built by the composition
root, `root/manager.py`), encodes.

Bodies are decoded by msgspec (not FastAPI), so every rejection uses the contract's body:
malformed JSON -> 400 `malformed_json`; wrong types or unknown fields -> 422 `invalid_schema`.
A streamed rollout is answered by `streaming.py`; the routes' types and their OpenAPI schemas
are `openapi.py`'s.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextlib import aclosing
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from april_client.protocol import (
    AbortReq,
    ErrorDetail,
    ErrorResp,
    GroupsReq,
    InputReq,
    LengthsForgotten,
    RejectReq,
    ResumeReq,
    ResumeResp,
    RolloutReq,
)
from april_server.buffer.buffer_index import PartialsFilter
from april_server.http.metrics import CONTENT_TYPE, prometheus_text
from april_server.http.openapi import PREFIX, extend_openapi
from april_server.http.streaming import stream_rollout
from april_server.root.manager import RolloutManager
from april_server.settings.config import AprilConfig
from april_server.wire.auth import AuthPolicy
from april_server.wire.errors import ApiError, bad_request

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024 * 1024  # a rollout body of prompts; larger is a client bug

T = TypeVar("T")
_enc = msgspec.json.Encoder()


def error_response(status: int, code: str, message: str) -> Response:
    body = ErrorResp(error=ErrorDetail(code=code, message=message))
    return Response(_enc.encode(body), status_code=status, media_type="application/json")


def json_response(obj: Any) -> Response:
    return Response(_enc.encode(obj), media_type="application/json")


async def read_bounded(request: Request) -> bytes:
    """The body, refused (413) as soon as it passes `MAX_BODY_BYTES`: a declared
    Content-Length is checked before anything is read, and a chunked body is counted as it
    arrives, so an oversize upload is never held whole in memory."""
    too_large = ApiError(413, "body_too_large", f"the body exceeds {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async with aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise too_large
            chunks.append(chunk)
    return b"".join(chunks)


async def decode(request: Request, typ: type[T]) -> T:
    body = await read_bounded(request)
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid_schema", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None


def check_limits(req: RolloutReq | GroupsReq, config: AprilConfig) -> None:
    if len(req.groups) > config.max_groups_per_call:
        raise ApiError(
            413, "too_many_groups", f"at most {config.max_groups_per_call} groups per call"
        )
    for g in req.groups:
        # n >= 1 here, not only where the group is built: the sum below must not be lowered
        # by a negative n after thousands of groups have been built.
        if not 1 <= g.n <= config.max_n:
            raise ApiError(400, "invalid_n", f"group {g.group_id!r}: n lies in [1, {config.max_n}]")
    samples = sum(g.n for g in req.groups)
    if samples > config.max_samples_per_call:
        raise ApiError(
            413,
            "too_many_samples",
            f"{samples} samples (the sum of n); at most {config.max_samples_per_call} per call",
        )


DEFAULT_PAGE = 1000
MAX_PAGE = 10_000


def partials_query(request: Request) -> tuple[int, int, PartialsFilter]:
    """`?limit=N&cursor=C&status=partial|finished&min_age_s=S&weight_version=V`."""
    q = request.query_params
    try:
        limit = int(q.get("limit", DEFAULT_PAGE))
        start = int(q.get("cursor", 0))
        min_age = None if q.get("min_age_s") is None else float(q["min_age_s"])
    except ValueError:
        raise bad_request(
            "invalid_request", "limit and cursor are integers, min_age_s a number"
        ) from None
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request("invalid_request", f"limit must lie in [1, {MAX_PAGE}]")
    if start < 0:
        raise bad_request("invalid_request", "cursor comes from a previous page's next_cursor")
    if min_age is not None and not min_age >= 0:
        raise bad_request("invalid_request", "min_age_s must be >= 0")
    status = q.get("status")
    if status not in (None, "partial", "finished"):
        raise bad_request("invalid_request", "status is 'partial' or 'finished'")
    where = PartialsFilter(status, min_age, q.get("weight_version"))  # type: ignore[arg-type]
    return start, limit, where


def create_router(
    get_manager: Callable[[], RolloutManager],
    config: AprilConfig | None = None,
    auth: AuthPolicy | None = None,
    engine_ready: Callable[[], None] = lambda: None,
) -> APIRouter:
    """Routes over a manager that may be built lazily (SGLang starts its engine first).
    `engine_ready` raises (503) when nothing could generate now: an owner whose engines are
    all down still serves its buffer, but not generation."""
    router = APIRouter()
    config = config or AprilConfig()
    auth = auth or AuthPolicy()

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        # One place checks the caller and turns ApiError into the contract's error body.
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                request = kwargs.get("request")
                header = None if request is None else request.headers.get("authorization")
                auth.require_user(header)
                return await fn(*args, **kwargs)
            except ApiError as exc:
                return error_response(exc.status, exc.code, exc.message)

        return wrapper

    @router.post(PREFIX + "/rollouts")
    @guarded
    async def rollouts(request: Request) -> Response:
        """Batch-quota rollout (the APRIL step)."""
        req = await decode(request, RolloutReq)
        check_limits(req, config)
        mgr = get_manager()
        engine_ready()
        if not req.stream:
            return json_response(await mgr.rollout(req))
        return await stream_rollout(mgr.rollout, req)

    @router.post(PREFIX + "/groups")
    @guarded
    async def groups(request: Request) -> Response:
        """Hand groups in without waiting (prefetch); `start: background` generates them
        between calls."""
        req = await decode(request, GroupsReq)
        check_limits(req, config)
        return json_response(await get_manager().add_groups(req))

    @router.post(PREFIX + "/rollouts/{batch_id}/reject")
    @guarded
    async def reject(batch_id: str, request: Request) -> Response:
        """Un-count finished groups of a running streamed rollout."""
        body = await decode(request, RejectReq)
        get_manager().reject(batch_id, body)
        return json_response({"batch_id": batch_id, "rejected": body.group_ids})

    @router.post(PREFIX + "/abort")
    @guarded
    async def abort(request: Request) -> Response:
        """Stop generation in scope; returns when nothing in scope is generating."""
        req = await decode(request, AbortReq)
        if req.all:
            auth.require_admin(request.headers.get("authorization"), "abort with all=true")
        return json_response(await get_manager().abort(req))

    @router.post(PREFIX + "/resume")
    @guarded
    async def resume(request: Request) -> Response:
        """Continue buffered samples until they finish."""
        req = await decode(request, ResumeReq)
        mgr = get_manager()
        engine_ready()
        return json_response(ResumeResp(samples=await mgr.resume(req)))

    # `:path`: a sample id is "{group_id}/{index}".
    @router.post(PREFIX + "/samples/{sample_id:path}/input")
    @guarded
    async def sample_input(sample_id: str, request: Request) -> Response:
        """The tool's answer for a member awaiting input (agent rollouts)."""
        req = await decode(request, InputReq)
        return json_response(await get_manager().post_input(sample_id, req))

    @router.get(PREFIX + "/partials")
    @guarded
    async def partials(request: Request) -> Response:
        """The idle buffer, a page at a time, oldest first (`?limit`, `?cursor`, filters)."""
        start, limit, where = partials_query(request)
        return json_response(await get_manager().list_partials(start, limit, where))

    # `:path`, so a group id from before the contract's identifier rule (one with a "/") is
    # still reachable, URL-encoded; new ids cannot contain "/".
    @router.get(PREFIX + "/partials/{group_id:path}")
    @guarded
    async def partial(group_id: str, request: Request) -> Response:
        return json_response(await get_manager().show_partial(group_id))

    @router.delete(PREFIX + "/partials/{group_id:path}")
    @guarded
    async def delete_partial(group_id: str, request: Request) -> Response:
        auth.require_admin(request.headers.get("authorization"), "deleting buffered groups")
        return json_response(await get_manager().delete(group_id))

    @router.get(PREFIX + "/weights/group")
    @guarded
    async def weight_group(request: Request) -> Response:
        """What a trainer's weight-update group needs here (docs/api.md)."""
        return json_response(get_manager().weight_group())

    @router.delete(PREFIX + "/lengths")
    @guarded
    async def forget_lengths(request: Request) -> Response:
        """Forget every prompt's length history (docs/api.md, Length prediction)."""
        auth.require_admin(request.headers.get("authorization"), "forgetting length histories")
        return json_response(LengthsForgotten(forgotten_prompts=get_manager().forget_lengths()))

    @router.get(PREFIX + "/stats")
    @guarded
    async def stats(request: Request) -> Response:
        return json_response(await get_manager().stats())

    @router.get(PREFIX + "/metrics", response_class=PlainTextResponse)
    @guarded
    async def april_metrics(request: Request) -> Response:
        """The figures of /stats as Prometheus text."""
        text = prometheus_text(await get_manager().stats())
        return Response(content=text, media_type=CONTENT_TYPE)

    # Registered before SGLang mounts its own /metrics (at start-up, with --enable-metrics), so
    # this route answers first and includes SGLang's families: one scrape target, both sets.
    # Open without a key, as SGLang keeps /metrics (its auth middleware exempts the path).
    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        """The figures of /stats, and SGLang's own when it runs with --enable-metrics. A
        server that cannot build its figures yet (an owner before any engine answered) says
        so with 200: a scrape is not an error."""
        try:
            text = prometheus_text(await get_manager().stats(), with_engine=True)
        except ApiError as exc:
            text = f"# april-server: no figures yet: {exc.message}\n".encode()
        return Response(content=text, media_type=CONTENT_TYPE)

    return router


def extend_app(app: FastAPI) -> None:
    """What the routes need from the app they are mounted on: the contract's error body for
    routing errors under our prefix and on our /metrics (unknown path, wrong method), and our
    schemas."""
    previous = app.exception_handlers.get(StarletteHTTPException, http_exception_handler)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        ours = request.url.path.startswith(PREFIX + "/") or request.url.path == "/metrics"
        if ours and isinstance(exc, StarletteHTTPException):
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
            return error_response(
                exc.status_code, code, f"{request.method} {request.url.path}: {exc.detail}"
            )
        result = previous(request, exc)
        return await result if inspect.isawaitable(result) else result

    app.add_exception_handler(StarletteHTTPException, on_http_error)
    extend_openapi(app)
