"""The `/april/v1` routes. Each handler decodes, calls the manager, encodes.

Bodies are decoded by msgspec (not FastAPI), so every rejection uses the contract's body:
malformed JSON -> 400 `malformed_json`; wrong types or unknown fields -> 422 `invalid_schema`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from april_server.errors import ApiError, not_found
from april_server.manager import RolloutManager
from april_server.protocol import (
    AbortReq,
    DoneEvent,
    ErrorDetail,
    ErrorResp,
    GroupFinishedEvent,
    PartialsResp,
    RejectReq,
    ResumeReq,
    ResumeResp,
    RolloutReq,
    RolloutResp,
    StreamEvent,
)
from april_server.rollout import rollout

logger = logging.getLogger(__name__)
PREFIX = "/april/v1"
MAX_BODY_BYTES = 64 * 1024 * 1024  # a rollout body of prompts; larger is a client bug

T = TypeVar("T")
_enc = msgspec.json.Encoder()


def error_response(status: int, code: str, message: str) -> Response:
    body = ErrorResp(error=ErrorDetail(code=code, message=message))
    return Response(_enc.encode(body), status_code=status, media_type="application/json")


def json_response(obj: Any) -> Response:
    return Response(_enc.encode(obj), media_type="application/json")


async def decode(request: Request, typ: type[T]) -> T:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, "body_too_large", f"the body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid_schema", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None


def create_router(get_manager: Callable[[], RolloutManager]) -> APIRouter:
    """Routes over a manager that may be built lazily (SGLang starts its engine first)."""
    router = APIRouter()

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        # One place turns ApiError into the contract's error body.
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except ApiError as exc:
                return error_response(exc.status, exc.code, exc.message)

        return wrapper

    @router.post(PREFIX + "/rollouts")
    @guarded
    async def rollouts(request: Request) -> Response:
        """Batch-quota rollout (the APRIL step)."""
        req = await decode(request, RolloutReq)
        mgr = get_manager()
        if not req.stream:
            return json_response(await rollout(mgr, req))
        return await stream_rollout(mgr, req)

    @router.post(PREFIX + "/rollouts/{batch_id}/reject")
    @guarded
    async def reject(batch_id: str, request: Request) -> Response:
        """Un-count finished groups of a running streamed rollout."""
        body = await decode(request, RejectReq)
        call = get_manager().calls.get(batch_id)
        if call is None:
            raise not_found(f"no running rollout {batch_id!r}")
        call.reject(body)
        return json_response({"batch_id": batch_id, "rejected": body.group_ids})

    @router.post(PREFIX + "/abort")
    @guarded
    async def abort(request: Request) -> Response:
        """Stop generation in scope; returns when nothing in scope is generating."""
        return json_response(await get_manager().abort(await decode(request, AbortReq)))

    @router.post(PREFIX + "/resume")
    @guarded
    async def resume(request: Request) -> Response:
        """Continue buffered samples until they finish."""
        req = await decode(request, ResumeReq)
        return json_response(ResumeResp(samples=await get_manager().resume(req)))

    @router.get(PREFIX + "/partials")
    @guarded
    async def partials() -> Response:
        mgr = get_manager()
        groups = mgr.idle_groups()
        await mgr.snapshots.refresh([s for g in groups for s in g.samples])
        return json_response(PartialsResp(groups=[mgr.listed(g) for g in groups]))

    @router.get(PREFIX + "/partials/{group_id}")
    @guarded
    async def partial(group_id: str) -> Response:
        mgr = get_manager()
        return json_response(mgr.listed(mgr.group(group_id)))

    @router.delete(PREFIX + "/partials/{group_id}")
    @guarded
    async def delete_partial(group_id: str) -> Response:
        return json_response(await get_manager().delete(group_id))

    @router.get(PREFIX + "/stats")
    @guarded
    async def stats() -> Response:
        return json_response(await get_manager().stats())

    return router


async def stream_rollout(mgr: RolloutManager, req: RolloutReq) -> Response:
    """NDJSON: `group_finished` events as groups finish, then `done`. Validation errors come
    back as a normal error response, before the stream starts."""
    events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    task = loop.create_task(rollout(mgr, req, events, ready))
    await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        task.result()  # validation failed: raises the ApiError

    async def lines() -> AsyncIterator[bytes]:
        sent: set[str] = set()
        try:
            while not (task.done() and events.empty()):
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                ev = getter.result()
                if isinstance(ev, GroupFinishedEvent):
                    sent.add(ev.group.group_id)
                    yield _enc.encode(ev) + b"\n"
            resp: RolloutResp = task.result()
            for g in resp.groups:  # a replayed (idempotent) call emits its stored groups
                if g.group_id not in sent:
                    yield _enc.encode(GroupFinishedEvent(group=g)) + b"\n"
            done = DoneEvent(
                batch_id=resp.batch_id, buffered_group_ids=resp.buffered_group_ids, stats=resp.stats
            )
            yield _enc.encode(done) + b"\n"
        finally:
            if not task.done():  # the client went away: stop the call, keep everything
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    return StreamingResponse(lines(), media_type="application/x-ndjson")
