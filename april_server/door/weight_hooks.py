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
session's `begin_weight_update`, held until its `end_weight_update`): the process's
`WeightSession` (`engine/weight_session.py`, the same one an owner runs over its engines) cuts
our running segments at the version boundary first, through the root's weight cut
(`engine/weight_cut.py`: abort; their tokens are kept, with the old version), so SGLang's
writer lock is free within a decode step; once the update is done they continue under the new
weights as new segments. Requests of other clients are not ours to cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from april_server.engine.weight_session import WeightGroup, WeightSession

logger = logging.getLogger(__name__)

UPDATED_BUT_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
FLUSH_RETRY_S = 0.05
FLUSH_DEADLINE_S = 30.0  # aborted requests leave within a decode step or two
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager."


class WeightHooks:
    """SGLang's weight routes on this server, around the process's weight session (handed in
    by the command line, which hands the same session the root's weight cut once the root is
    built): pushes and sessions cut our segments; the group joined is remembered."""

    def __init__(self, session: WeightSession) -> None:
        self.session = session

    def register(self) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for name in ("disk", "tensor", "distributed", "ipc"):
            HookRegistry.register(
                _TM + "update_weights_from_" + name, self.around_update, HookType.AROUND
            )
        # SGLang's weight-update session (`/begin_weight_update` ... `/end_weight_update`,
        # which 0.5.23 requires around `update_weights_from_distributed`): each takes the
        # writer lock for its message, so it too would wait for every running request (72-92 s
        # behind background generation, measured). Our segments are cut for it and continue
        # once it has ended (`WeightSession.begin`/`end`).
        HookRegistry.register(_TM + "begin_weight_update", self.around_begin, HookType.AROUND)
        HookRegistry.register(_TM + "end_weight_update", self.around_end, HookType.AROUND)
        # Which weight-update group the scheduler is in (`GET /april/v1/weights/group`): a
        # trainer learns from it whether a push reaches this server (a restarted one is in none).
        for name, hook in (
            ("init_weights_update_group", self.around_init_group),
            ("destroy_weights_update_group", self.around_destroy_group),
        ):
            HookRegistry.register(_TM + name, hook, HookType.AROUND)

    async def around_init_group(self, original: Any, tm: Any, obj: Any, *a: Any, **kw: Any) -> Any:
        success, message = await original(tm, obj, *a, **kw)
        if success:
            self.session.joined(WeightGroup(obj.group_name, int(obj.world_size)))
        return success, message

    async def around_destroy_group(
        self, original: Any, tm: Any, obj: Any, *a: Any, **kw: Any
    ) -> Any:
        success, message = await original(tm, obj, *a, **kw)
        self.session.left(obj.group_name)
        return success, message

    async def around_begin(self, original: Any, tm: Any, obj: Any, *a: Any, **kw: Any) -> Any:
        return await self.session.begin(
            lambda: original(tm, obj, *a, **kw),
            succeeded=lambda result: bool(result[0]),
            abort_all=bool(getattr(obj, "abort_all_requests", False)),
        )

    async def around_end(self, original: Any, tm: Any, obj: Any, *a: Any, **kw: Any) -> Any:
        return await self.session.end(lambda: original(tm, obj, *a, **kw))

    async def around_update(
        self, original: Any, tm: Any, obj: Any, *args: Any, **kwargs: Any
    ) -> tuple[Any, ...]:
        """Every `update_weights_from_*` (disk answers (success, message, paused), the others
        (success, message)): the flush SGLang refuses while cut requests are still leaving
        the batch is done once they have left (seen with a broadcast during background
        generation). Our cut segments continue only after the flush: they would make it fail
        again."""
        abort_all = bool(getattr(obj, "abort_all_requests", False))
        async with self.session.push(abort_all):
            result = tuple(await original(tm, obj, *args, **kwargs))
            success, message = result[0], result[1]
            if success or not str(message).startswith(UPDATED_BUT_NOT_FLUSHED):
                return result
            # The scheduler runs the new weights and stamps their version: say it here too.
            if obj.weight_version is not None:
                tm._update_weight_version_if_provided(obj.weight_version)
            if await flush_when_idle(tm, abort=abort_all):
                version = obj.weight_version
                note = f" Weight version updated to {version}." if version else ""
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
