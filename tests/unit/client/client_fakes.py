"""Canned server answers and runners shared by the client tests: each call goes through both
clients (sync, then async) over `httpx.MockTransport`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from april_client import AprilClient, AprilError, AsyncAprilClient

ROOT = Path(__file__).resolve().parents[3]
URL = "http://april.test"
Handler = Callable[[httpx.Request], httpx.Response]

SAMPLE = {
    "sample_id": "g/0", "group_id": "g", "index": 0, "status": "partial", "prompt_ids": [1],
    "output_ids": [2], "output_logprobs": [-0.1], "segments": [], "max_new_tokens": 4,
    "finish_reason": None,
}  # fmt: skip
GROUP = {"group_id": "g", "samples": [SAMPLE]}
STATS = {
    "wall_s": 0.1, "weight_version": "0", "num_finished_groups": 1, "num_buffered_groups": 0,
    "output_tokens": 1, "offpolicy_tokens": 0, "resumed_samples": 0, "restored_kv_tokens": 0,
    "recomputed_tokens": 0,
}  # fmt: skip
ROLLOUT = {"batch_id": "b", "groups": [GROUP], "buffered_group_ids": ["h"], "stats": STATS}
SPEC = {"group_id": "g", "input_ids": [1]}
FINISHED_LINE = (
    json.dumps({"event": "group_finished", "group": GROUP, "batch_id": "b"}).encode() + b"\n"
)
DONE_LINE = (
    json.dumps({"event": "done", "batch_id": "b", "buffered_group_ids": [], "stats": STATS}) + "\n"
).encode()


def answer(status: int = 200, body: Any = None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.Response(status, content=content)
    return httpx.Response(status, json={} if body is None else body)


def recorder(status: int = 200, body: Any = None, content: bytes | None = None) -> Any:
    """A handler giving one canned answer, and the list of requests it saw."""
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return answer(status, body, content)

    return seen, handler


def run_sync(handler: Handler, call: Callable[[Any], Any], **kw: Any) -> Any:
    with AprilClient(URL, transport=httpx.MockTransport(handler), **kw) as c:
        return call(c)


def run_async(handler: Handler, call: Callable[[Any], Any], **kw: Any) -> Any:
    async def go() -> Any:
        async with AsyncAprilClient(URL, transport=httpx.MockTransport(handler), **kw) as c:
            return await call(c)

    return asyncio.run(go())


RUNNERS = (run_sync, run_async)


def both(handler: Handler, call: Callable[[Any], Any], **kw: Any) -> list[Any]:
    """`call` on the sync client, then (awaited) on the async one, over the same handler."""
    return [run(handler, call, **kw) for run in RUNNERS]


def both_raise(handler: Handler, call: Callable[[Any], Any], **kw: Any) -> list[AprilError]:
    errors: list[AprilError] = []
    for run in RUNNERS:
        with pytest.raises(AprilError) as e:
            run(handler, call, **kw)
        errors.append(e.value)
    return errors


def refuse(req: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("refused", request=req)


def unavailable(req: httpx.Request) -> httpx.Response:
    return answer(503, {"error": {"code": "overloaded", "message": "try later"}})
