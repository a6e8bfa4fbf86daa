"""`/april/v1/engine/*`: one april-server's engine, exposed to an owner on another machine.

Every april-server mounts these routes, so any of them can serve as an engine of a fleet. They
are thin: each decodes, calls the local `SnapshotEngine`, encodes. The owner names slots by
its own engine names; here every slot is the local one (`LOCAL`, the DP rank it gives).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from april_server.engine.base import BaseEngine, SnapshotEngine
from april_server.fleet.engine_wire import (
    ENGINE_PREFIX,
    EngineInfo,
    KvResp,
    control_req,
    encoder,
    kv_req,
    segment_call,
)
from april_server.http.app import error_response
from april_server.rules.placement import LOCAL, Slot
from april_server.wire.auth import AuthPolicy
from april_server.wire.errors import ApiError, bad_request

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 1.0  # how often a running segment checks that its owner is still there


def engine_info(engine: BaseEngine) -> EngineInfo:
    stats = engine.engine_stats()
    group = engine.weight_group()
    return EngineInfo(
        context_len=engine.context_len,
        vocab_size=engine.vocab_size,
        dp_size=len(engine.slots()),
        weight_version=engine.weight_version(),
        assigns_seeds=engine.assigns_seeds,
        snapshots_enabled=isinstance(engine, SnapshotEngine) and engine.snapshots_enabled,
        model_path=str(stats.get("model_path", "")),
        has_tokenizer=bool(stats.get("has_tokenizer", True)),
        eos_token_ids=sorted(engine.eos_token_ids),
        tp_size=group.ranks,
        weight_group=group.group,
        routing_format=engine.routing_format,
        sampling_mask_tokens=engine.sampling_mask_tokens,
    )


def _ok(obj: Any) -> Response:
    return Response(encoder.encode(obj), media_type="application/json")


async def _body(request: Request, decode: Callable[[bytes], Any]) -> Any:
    try:
        return decode(await request.body())
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ApiError(422, "invalid_schema", str(exc)) from None


async def _watch_owner(request: Request, engine: BaseEngine, rid: str) -> None:
    """Abort `rid` if the owner goes away (it crashed, or gave up on this engine): nobody
    would read the segment, and it would hold a running slot to its end."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    logger.warning("april: owner of %s went away; aborting it", rid)
    engine.abort(rid)


def create_engine_router(get_engine: Callable[[], BaseEngine], auth: AuthPolicy) -> APIRouter:
    router = APIRouter()

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def wrapper(request: Request) -> Response:
            try:
                auth.require_admin(request.headers.get("authorization"), "engine routes")
                return await fn(request)  # type: ignore[no-any-return]
            except ApiError as exc:
                return error_response(exc.status, exc.code, exc.message)

        return wrapper

    def snap() -> SnapshotEngine:
        engine = get_engine()
        if not isinstance(engine, SnapshotEngine) or not engine.snapshots_enabled:
            raise bad_request("kv_disabled", "this engine keeps no KV snapshots")
        return engine

    @router.get(ENGINE_PREFIX + "/info")
    @guarded
    async def info(request: Request) -> Response:
        return _ok(engine_info(get_engine()))

    @router.post(ENGINE_PREFIX + "/segment")
    @guarded
    async def segment(request: Request) -> Response:
        """Run one planned segment (`SnapshotEngine.run_segment`): drop, restore, generate,
        release, and the snapshot an abort left."""
        call = await _body(request, segment_call.decode)
        engine = get_engine()
        watch = asyncio.ensure_future(_watch_owner(request, engine, call.rid))
        try:
            out = await engine.run_segment(call)
        finally:
            watch.cancel()
        if watch.done() and not watch.cancelled() and isinstance(engine, SnapshotEngine):
            # Its owner went away: nobody will learn of a snapshot its abort left, or free it.
            if engine.snapshots_enabled and out.snapshot_bytes:
                await engine.drop_snapshot(call.key, out.slot)
        return _ok(out)

    @router.post(ENGINE_PREFIX + "/control")
    @guarded
    async def control(request: Request) -> Response:
        """Marks and aborts, in the order given (a mark must precede its abort)."""
        body = await _body(request, control_req.decode)
        engine = get_engine()
        for op in body.ops:
            if op.op == "mark":
                snap().mark_snapshot(op.rid, op.key, Slot(LOCAL, op.dp_rank))
            else:
                engine.abort(op.rid)
        return _ok({"done": len(body.ops)})

    @router.post(ENGINE_PREFIX + "/kv")
    @guarded
    async def kv(request: Request) -> Response:
        req = await _body(request, kv_req.decode)
        engine, slot = snap(), Slot(LOCAL, req.dp_rank)
        if req.op == "drop":
            await engine.drop_snapshot(req.key, slot)
            return _ok(KvResp())
        if req.op == "keys":  # {dp_rank: {key: age_s}}, every rank
            held = await engine.snapshot_keys()
            return _ok(KvResp(info={str(s.dp_rank): ages for s, ages in held.items()}))
        if req.op == "info":
            return _ok(KvResp(info=await engine.snapshot_info(req.key, slot)))
        if req.op == "restore":
            restored = await engine.restore_snapshot(req.key, slot, req.namespace)
            return _ok(KvResp(restored=restored))
        await engine.release_snapshot(req.key, slot)
        return _ok(KvResp())

    @router.get(ENGINE_PREFIX + "/figures")
    @guarded
    async def figures(request: Request) -> Response:
        """Snapshot stats, capacity, step curve and engine clock, in one round trip."""
        engine = get_engine()
        cap = await engine.capacity()
        curve = await engine.step_curve()
        out: dict[str, Any] = {
            "capacity": None if cap is None else [cap.max_running_requests, cap.max_total_tokens],
            "step_curve": {str(b): v for b, v in curve.items()},
            "clock": await engine.engine_clock(),
            "snapshots": None,
        }
        if isinstance(engine, SnapshotEngine) and engine.snapshots_enabled:
            out["snapshots"] = await engine.snapshot_stats()
        return _ok(out)

    return router
