"""The few server calls the benchmark makes besides generation: probing, load polling, weight
version bumps and partial-buffer housekeeping. Plain httpx, so the bench has no other deps."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

R = "/april/v1"


class BenchError(RuntimeError):
    """The run cannot go on (server refused something); the message says what to fix."""


def check(resp: httpx.Response, what: str) -> Any:
    if resp.status_code >= 400:
        raise BenchError(f"{what}: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp.json()


async def rollout_events(http: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[Any]:
    """The events of a streamed `/rollouts` call, in order (BenchError on an error status)."""
    async with http.stream("POST", R + "/rollouts", json=body) as resp:
        if resp.status_code >= 400:
            raise BenchError(f"POST rollouts: HTTP {resp.status_code}: {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if line.strip():
                yield json.loads(line)


@dataclass
class ServerInfo:
    model_path: str
    weight_version: str
    vocab_size: int
    context_len: int
    has_tokenizer: bool
    kv_snapshots: bool
    kv_reason: str
    sglang_version: str
    background: bool = False  # on_quota continue and POST /groups (/stats background_groups)


def kv_availability(stats: dict[str, Any]) -> tuple[bool, str]:
    """Whether the server keeps KV snapshots, from `/april/v1/stats` `kv_snapshots`."""
    kv = stats.get("kv_snapshots")
    if kv is None:
        return False, "the server's /april/v1/stats does not report kv_snapshots"
    if isinstance(kv, str):
        ok = not kv.lower().startswith(("not available", "unavailable", "disabled"))
        return ok, kv
    if isinstance(kv, dict):
        ok = bool(kv.get("available", kv.get("enabled", True)))
        return ok, str(kv.get("reason", "")) if not ok else "available"
    return bool(kv), "available" if kv else "kv_snapshots is false"


async def probe(http: httpx.AsyncClient) -> ServerInfo:
    info = check(await http.get("/model_info"), "GET /model_info")
    stats = check(await http.get(R + "/stats"), "GET /april/v1/stats")
    server = check(await http.get("/server_info"), "GET /server_info")
    engine = stats.get("engine") or {}
    ok, reason = kv_availability(stats)
    return ServerInfo(
        model_path=str(info.get("model_path") or server.get("model_path")),
        weight_version=str(info.get("weight_version") or stats.get("weight_version")),
        vocab_size=int(engine.get("vocab_size") or 512),
        context_len=int(engine.get("context_len") or 4096),
        has_tokenizer=not bool(server.get("skip_tokenizer_init")),
        kv_snapshots=ok,
        kv_reason=reason,
        sglang_version=str(server.get("version", "")),
        background="background_groups" in stats,
    )


async def bump_version(http: httpx.AsyncClient, model_path: str, version: str) -> float:
    """Reload the same weights under a new weight_version; returns the seconds it took."""
    t0 = time.perf_counter()
    body = {"model_path": model_path, "weight_version": version}
    out = check(await http.post("/update_weights_from_disk", json=body), "weight update")
    if isinstance(out, dict) and out.get("success") is False:
        raise BenchError(f"weight update to {version!r} failed: {out.get('message')}")
    return time.perf_counter() - t0


async def flush_cache(http: httpx.AsyncClient) -> None:
    """Empty SGLang's prefix cache (its answer is plain text, so only the status is checked)."""
    resp = await http.post("/flush_cache")
    if resp.status_code >= 400:
        raise BenchError(f"POST /flush_cache: HTTP {resp.status_code}: {resp.text[:200]}")


async def forget_lengths(http: httpx.AsyncClient) -> None:
    """Clear the server's per-prompt length history, so a mode predicts only from its own
    rollouts, not from the prompts an earlier mode ran. A server without the route (404) has
    no history to clear."""
    resp = await http.delete(R + "/lengths")
    if resp.status_code not in (200, 404):
        raise BenchError(f"DELETE /lengths: HTTP {resp.status_code}: {resp.text[:200]}")


async def buffered_groups(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = check(await http.get(R + "/partials"), "GET partials")["groups"]
    return groups


async def delete_groups(http: httpx.AsyncClient, group_ids: list[str]) -> None:
    for gid in group_ids:
        check(await http.delete(f"{R}/partials/{gid}"), f"DELETE partials/{gid}")


async def abort_groups(http: httpx.AsyncClient, group_ids: list[str]) -> None:
    """Stop these groups generating (tokens kept, they stay buffered); idempotent."""
    if group_ids:
        body = {"group_ids": group_ids, "keep": "tokens"}
        check(await http.post(R + "/abort", json=body), "POST /abort")


async def background_tokens(http: httpx.AsyncClient) -> int:
    """Tokens the server generated between calls so far (`/stats` background_output_tokens)."""
    stats = check(await http.get(R + "/stats"), "GET stats")
    return int(stats.get("background_output_tokens") or 0)


async def engine_clock(http: httpx.AsyncClient) -> dict[str, float]:
    """The engine's cumulative forward seconds/tokens by kind (`/stats` `engine_time`); empty
    on a server that does not report them."""
    stats = check(await http.get(R + "/stats"), "GET stats")
    return {k: float(v) for k, v in (stats.get("engine_time") or {}).items()}


async def running_reqs(http: httpx.AsyncClient) -> int:
    loads = (await http.get("/v1/loads")).json().get("loads", [])
    return sum(int(x.get("num_running_reqs", 0)) for x in loads)


class LoadPoller:
    """Samples SGLang's running batch (`/v1/loads`) in the background at `hz`."""

    def __init__(self, http: httpx.AsyncClient, hz: float, t0: float) -> None:
        self.http = http
        self.period = 1.0 / hz if hz > 0 else 0.0
        self.t0 = t0
        self.samples: list[tuple[float, int]] = []
        self.errors = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            try:
                running = await running_reqs(self.http)
                self.samples.append((time.perf_counter() - self.t0, running))
            except (httpx.HTTPError, ValueError):
                self.errors += 1
            await asyncio.sleep(max(0.0, self.period - (time.perf_counter() - t)))

    def start(self) -> None:
        if self.period > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
