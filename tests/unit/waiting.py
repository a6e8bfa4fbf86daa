"""Waiting on a condition instead of sleeping a fixed time: on a busy machine a fixed sleep
is sometimes too short (and always too long elsewhere)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Return once `cond()` holds, polling every 10 ms; fail after `timeout` seconds."""
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)
