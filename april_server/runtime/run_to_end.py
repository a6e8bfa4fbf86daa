"""Work that must not stop halfway when its caller goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def run_to_end(aw: Awaitable[T]) -> T:
    """Await `aw` to its end even if the caller is cancelled meanwhile (a client that goes
    away, possibly more than once), then re-raise the cancellation: half a call would leave
    requests generating, groups claimed, or a buffer that differs from the disk."""
    work = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(work)
            break
        except asyncio.CancelledError:
            if work.done() and work.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
