"""HTTP-process side of weight updates, installed through SGLang's plugin hooks.

AROUND `TokenizerManager.update_weights_from_disk`: SGLang 0.5.23 loads the new weights, stamps
their version on the scheduler, then flushes the prefix cache. With `abort_all_requests` the
flush can come before the aborted requests have left the running batch; SGLang then answers
400 "Weights were updated, but the cache was not flushed" and leaves the tokenizer's version at
the old one, while the scheduler already stamps outputs with the new one. A trainer that checks
the status (AReaL does) believes its update failed while the server runs the new weights.

The hook finishes the update the caller asked for: it records the new version where the
tokenizer (our `/stats`, the KV-reuse rule) reads it, so it equals the stamp on outputs, and
flushes once the aborted requests are out (under the update lock, so nothing new starts in
between; requests still generating are aborted again, as the caller asked), then answers 200.
Without `abort_all_requests` SGLang's writer lock already waits for every request, so the
flush cannot race and the hook passes the answer through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

UPDATED_BUT_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
FLUSH_RETRY_S = 0.05
FLUSH_DEADLINE_S = 30.0  # aborted requests leave within a decode step or two


def register_weight_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_weights_from_disk",
        _around_update_from_disk,
        HookType.AROUND,
    )


async def _around_update_from_disk(
    original: Any, tm: Any, obj: Any, *args: Any, **kwargs: Any
) -> tuple[bool, str, int]:
    success, message, paused = await original(tm, obj, *args, **kwargs)
    if success or not str(message).startswith(UPDATED_BUT_NOT_FLUSHED):
        return success, message, paused
    # The scheduler runs the new weights and stamps their version: say the same version here.
    if obj.weight_version is not None:
        tm._update_weight_version_if_provided(obj.weight_version)
    if not obj.abort_all_requests:
        return success, message, paused  # not ours to abort what the caller left running
    if await flush_when_aborted(tm):
        note = f" Weight version updated to {obj.weight_version}." if obj.weight_version else ""
        logger.info("april: weights updated; the cache flushed once aborted requests left")
        return True, "Succeeded to update model weights (cache flushed after the abort)." + note, 0
    return success, message, paused


async def flush_when_aborted(tm: Any) -> bool:
    """Flush the prefix cache once no request runs: under the update lock (new requests wait
    for it), aborting again whatever still generates. False if it never became idle."""
    end = time.monotonic() + FLUSH_DEADLINE_S
    async with tm.model_update_lock.writer_lock:
        while True:
            out = await tm.flush_cache()
            if bool(getattr(out, "success", False)):
                return True
            if time.monotonic() >= end:
                logger.error("april: the cache could not be flushed after a weight update")
                return False
            tm.abort_request(abort_all=True)
            await asyncio.sleep(FLUSH_RETRY_S)
