"""Streamed responses: a rollout as NDJSON events, and a stream that always runs its ending.

`stream_rollout` answers a `stream: true` rollout with `group_finished` events as groups
finish, then `done`; `StreamThen` is the response that runs its `then` once however the stream
ends (the owner's proxied `/generate` uses it too, `fleet/gateway.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi.responses import Response, StreamingResponse

from april_client.protocol import (
    DoneEvent,
    GroupFinishedEvent,
    RolloutReq,
    RolloutResp,
    StreamEvent,
)
from april_server.calls.rollout import Rollout

_enc = msgspec.json.Encoder()


async def stream_rollout(rollout: Rollout, req: RolloutReq) -> Response:
    """NDJSON: `group_finished` events as groups finish, then `done`. Validation errors come
    back as a normal error response, before the stream starts."""
    events: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    task = loop.create_task(rollout(req, events, ready))
    waiters: list[asyncio.Future[Any]] = [ready, task]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
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
                if ev is not None:  # turn events too (sample_awaiting, sample_interrupted)
                    yield _enc.encode(ev) + b"\n"
            resp: RolloutResp = task.result()
            for g in resp.groups:  # a replayed (idempotent) call emits its stored groups
                if g.group_id not in sent:
                    event = GroupFinishedEvent(group=g, batch_id=resp.batch_id)
                    yield _enc.encode(event) + b"\n"
            done = DoneEvent(
                batch_id=resp.batch_id, buffered_group_ids=resp.buffered_group_ids, stats=resp.stats
            )
            yield _enc.encode(done) + b"\n"
        finally:
            if not task.done():  # the client went away: stop the call, keep everything
                task.cancel()  # the call winds down by itself (rollout.py)

    async def stop_the_call() -> None:
        if not task.done():
            task.cancel()
        await asyncio.wait([task])

    return StreamThen(lines(), stop_the_call, media_type="application/x-ndjson")


class StreamThen(StreamingResponse):
    """A streamed response that runs `then` exactly once however it ends: the stream done,
    the client gone before or after the first chunk, an error. A generator's own `finally` is
    not enough: one that never started (a client gone before the first chunk) never runs it.
    For a streamed call, `then` stops the call (it winds down and buffers everything, instead
    of delivering its groups to nobody); for the owner's proxied `/generate`, it settles the
    engine's in-flight count."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        then: Callable[[], Awaitable[None]],
        status_code: int = 200,
        media_type: str | None = None,
    ) -> None:
        super().__init__(content, status_code=status_code, media_type=media_type)
        self.then = then

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.then()
