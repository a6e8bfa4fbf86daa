"""HTTP-process side of weight updates, installed through SGLang's plugin hooks.

AROUND every `TokenizerManager.update_weights_from_*`: SGLang 0.5.23 loads the new weights,
stamps their version on the scheduler, then flushes the prefix cache. With `abort_all_requests`,
or when segments we cut are still leaving the batch (seen with `update_weights_from_distributed`
inside a session during background generation: the session's writer lock is released between
its messages), the flush can come before the aborted requests have left the running batch;
SGLang then answers 400 "Weights were updated, but the cache was not flushed" and leaves the
tokenizer's version at the old one, while the scheduler already stamps outputs with the new
one. A trainer that checks the status (AReaL does) believes its update failed while the server
runs the new weights.

The hook finishes the update the caller asked for: it records the new version where the
tokenizer (our `/stats`, the KV-reuse rule) reads it, so it equals the stamp on outputs, and
flushes once the aborted requests are out (under the update lock, so nothing new starts in
between; requests still generating are aborted again, as the caller asked), then answers 200.
Without `abort_all_requests` SGLang's writer lock already waits for every request, so the
flush cannot race and the hook passes the answer through.

Weight pushes never wait for our stragglers (AROUND every `update_weights_from_*`, and the
session's `begin_weight_update`, held until its `end_weight_update`: `Session`): SGLang's
update takes a writer lock that waits until every request has finished. Without
`abort_all_requests`, the segment runner's weight cut first cuts our running segments at the
version boundary (`engine/weight_cut.py`, `WeightCut.before_update`: abort; their tokens are
kept, with the old version), so the lock is free within a decode step; once the update is done
they continue under the new weights as new segments (`after_update`). Requests of other
clients are not ours to cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

logger = logging.getLogger(__name__)

UPDATED_BUT_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
FLUSH_RETRY_S = 0.05
FLUSH_DEADLINE_S = 30.0  # aborted requests leave within a decode step or two


class UpdateListener(Protocol):
    async def before_update(self) -> None: ...

    def after_update(self) -> None: ...


# Callables giving the listener now (None while there is none, e.g. before the first call).
_listeners: list[Callable[[], UpdateListener | None]] = []


def listen(get: Callable[[], UpdateListener | None]) -> None:
    _listeners.append(get)


_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager."


def register_weight_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name in ("disk", "tensor", "distributed", "ipc"):
        HookRegistry.register(
            _TM + "update_weights_from_" + name, _around_update_flushing, HookType.AROUND
        )
    # SGLang's weight-update session (`/begin_weight_update` ... `/end_weight_update`, which
    # 0.5.23 requires around `update_weights_from_distributed`): each takes the writer lock for
    # its message, so it too would wait for every running request (72-92 s behind background
    # generation, measured). Our segments are cut for it and continue once it has answered.
    # A session holds them cut from its begin to its end (`Session`).
    HookRegistry.register(_TM + "begin_weight_update", _around_begin, HookType.AROUND)
    HookRegistry.register(_TM + "end_weight_update", _around_end, HookType.AROUND)
    # Which weight-update group the scheduler is in (`GET /april/v1/weights/group`): a trainer
    # learns from it whether a push reaches this server (a restarted server is in none).
    HookRegistry.register(_TM + "init_weights_update_group", _around_init_group, HookType.AROUND)
    HookRegistry.register(
        _TM + "destroy_weights_update_group", _around_destroy_group, HookType.AROUND
    )


class JoinedGroup:
    """The weight-update group this server's scheduler joined last (None: none, or destroyed)."""

    name: str | None = None
    world_size: int | None = None


async def _around_init_group(original: Any, tm: Any, obj: Any, *args: Any, **kw: Any) -> Any:
    success, message = await original(tm, obj, *args, **kw)
    if success:
        JoinedGroup.name, JoinedGroup.world_size = obj.group_name, int(obj.world_size)
    return success, message


async def _around_destroy_group(original: Any, tm: Any, obj: Any, *args: Any, **kw: Any) -> Any:
    success, message = await original(tm, obj, *args, **kw)
    if obj.group_name == JoinedGroup.name:
        JoinedGroup.name = JoinedGroup.world_size = None
    return success, message


# A weight-update session the trainer never ended gives the segments back after this (one
# server here; an owner's engines in fleet/weight_group.py).
SESSION_LIMIT_S = 300.0


class Session:
    """An open weight-update session holds our segments cut from `/begin_weight_update` to
    `/end_weight_update`: between its messages the model is mid-update (a trainer may send the
    weights in several buckets; in-place-quantized weights are unpacked at begin), so nothing of
    ours may generate then, and the updates inside it need no cut of their own (as an owner
    does for its engines). A session never ended gives the segments back after
    SESSION_LIMIT_S, so a trainer that died mid-push cannot stall the server for good."""

    open = False
    beginning = False  # a begin is waiting for SGLang's answer: a second one cuts nothing
    held: list[UpdateListener] = []
    watchdog: asyncio.Task[None] | None = None

    @classmethod
    def release(cls) -> None:
        held, cls.held, cls.open = cls.held, [], False
        if cls.watchdog is not None and cls.watchdog is not asyncio.current_task():
            cls.watchdog.cancel()
        cls.watchdog = None
        for x in held:
            x.after_update()

    @classmethod
    async def expire(cls) -> None:
        await asyncio.sleep(SESSION_LIMIT_S)
        logger.warning("april: a weight-update session was not ended in %.0f s", SESSION_LIMIT_S)
        cls.release()


async def _cut(obj: Any) -> list[UpdateListener]:
    cut = [] if getattr(obj, "abort_all_requests", False) else [g() for g in _listeners]
    ready = [x for x in cut if x is not None]
    for x in ready:
        await x.before_update()
    return ready


@asynccontextmanager
async def cut_at_version_boundary(obj: Any) -> AsyncIterator[None]:
    """Around an update: our segments end before it and continue after it. A caller that
    aborts everything (`abort_all_requests`) gets exactly that instead. Inside an open session
    they are held already."""
    if Session.open:
        yield
        return
    ready: list[UpdateListener] = []
    try:
        ready = await _cut(obj)
        yield
    finally:
        if Session.open:  # a session began meanwhile: its end continues them, not this push
            Session.held += ready
        else:
            for x in ready:
                x.after_update()


async def _around_begin(original: Any, tm: Any, obj: Any, *args: Any, **kw: Any) -> Any:
    if Session.open or Session.beginning:
        # SGLang refuses a second begin; nothing more to hold. Nor to let go: a begin still
        # waiting for its answer holds what it cut, and a refusal here must not release it.
        return await original(tm, obj, *args, **kw)
    Session.beginning = True
    opened = False
    ready: list[UpdateListener] = []
    try:
        ready = await _cut(obj)
        result = await original(tm, obj, *args, **kw)
        opened = bool(result[0])
        return result
    finally:
        Session.beginning = False
        if opened:
            Session.open, Session.held = True, Session.held + ready
            Session.watchdog = asyncio.get_running_loop().create_task(Session.expire())
        else:
            for x in ready:
                x.after_update()


async def _around_end(original: Any, tm: Any, obj: Any, *args: Any, **kw: Any) -> Any:
    try:
        return await original(tm, obj, *args, **kw)
    finally:  # ended or refused, the session is over for our segments
        Session.release()


async def _around_update_flushing(
    original: Any, tm: Any, obj: Any, *args: Any, **kwargs: Any
) -> tuple[Any, ...]:
    """Every `update_weights_from_*` (disk answers (success, message, paused), the others
    (success, message)): the flush SGLang refuses while cut requests are still leaving the
    batch is done once they have left (seen with a broadcast during background generation)."""
    # Our cut segments continue only after the flush: they would make it fail again.
    async with cut_at_version_boundary(obj):
        result = tuple(await original(tm, obj, *args, **kwargs))
        success, message = result[0], result[1]
        if success or not str(message).startswith(UPDATED_BUT_NOT_FLUSHED):
            return result
        # The scheduler runs the new weights and stamps their version: say it here too.
        if obj.weight_version is not None:
            tm._update_weight_version_if_provided(obj.weight_version)
        if await flush_when_idle(tm, abort=bool(getattr(obj, "abort_all_requests", False))):
            note = f" Weight version updated to {obj.weight_version}." if obj.weight_version else ""
            logger.info("april: weights updated; the cache flushed once the requests had left")
            done = "Succeeded to update model weights (cache flushed after a retry)." + note
            return (True, done, 0)[: len(result)]
        return result


async def flush_when_idle(tm: Any, abort: bool) -> bool:
    """Flush the prefix cache once no request runs: under the update lock (new requests wait
    for it; it waits for those still running), aborting again whatever still generates when
    the caller asked for everything to be aborted. False if it never became idle."""
    end = time.monotonic() + FLUSH_DEADLINE_S
    writer = tm.model_update_lock.writer_lock
    # Requests paused in place (`/pause_generation` mode in_place) hold their reader locks
    # and cannot leave until the trainer continues them, which it does after this push
    # answers: waiting for the lock without a bound would wedge the push, and every request.
    entering = asyncio.ensure_future(writer.__aenter__())
    await asyncio.wait({entering}, timeout=FLUSH_DEADLINE_S)
    if not entering.done():
        entering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await entering
    if entering.cancelled():
        logger.error(
            "april: the cache could not be flushed after a weight update: requests still hold "
            "the update lock after %.0f s (generation paused in place?)",
            FLUSH_DEADLINE_S,
        )
        return False
    entering.result()
    try:
        while True:
            out = await tm.flush_cache()
            if bool(getattr(out, "success", False)):
                return True
            if time.monotonic() >= end:
                logger.error("april: the cache could not be flushed after a weight update")
                return False
            if abort:
                tm.abort_request(abort_all=True)
            await asyncio.sleep(FLUSH_RETRY_S)
    finally:
        await writer.__aexit__(None, None, None)
