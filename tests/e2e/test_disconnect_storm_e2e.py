"""Streamed calls abandoned at random moments beside ordinary calls, with a full buffer (#23):
the server keeps answering and loses nothing. Before the fix one disconnect during a buffer
read killed the store's thread, and every later call, /partials and /stats hung."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import pytest

from tests.e2e.test_rollouts_e2e import R, clear_buffer, group
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
BUFFERED = 60
DISCONNECTS = 40
ORDINARY = 8
ANSWER_S = 10.0  # what "answers within a few seconds" means here, on a busy 2-core machine


async def fill_buffer(c: httpx.AsyncClient) -> set[str]:
    groups = [group(f"buf{i}", [i % 90 + 1, 4], [300], ignore_eos=True) for i in range(BUFFERED)]
    groups.append(group("buf-trigger", [1, 2], [2], ignore_eos=True))
    body = {"groups": groups, "target_groups": 1, "on_quota": "tokens", "max_inflight_groups": 61}
    r = await c.post(R + "/rollouts", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert [g["group_id"] for g in r.json()["groups"]] == ["buf-trigger"]
    return set(r.json()["buffered_group_ids"])


async def abandoned_stream(url: str, k: int, rng: random.Random) -> tuple[int, list[str]]:
    """A streamed call that takes buffered groups, then its client goes away mid-call.
    Returns its status (400 `invalid_target` when other calls had drained the buffer: its
    group was refused, never acknowledged) and the groups it delivered: none unless its
    `done` line arrived before the client left (a call that met its quota that fast)."""
    body = {
        "groups": [group(f"ab{k}", [k % 50 + 3, 9], [200], ignore_eos=True)],
        # Its own group always makes the target reachable: the call is accepted however much
        # of the buffer other calls have taken, and still claims buffered groups first.
        "target_groups": 1,
        "stream": True,
        "request_id": f"abandon-{k}",
    }
    await asyncio.sleep(rng.uniform(0, 2.0))
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:

        async def read(r: httpx.Response) -> None:
            async for line in r.aiter_lines():
                if line:
                    events.append(json.loads(line))

        try:
            async with c.stream("POST", R + "/rollouts", json=body) as r:
                status = r.status_code
                await asyncio.wait_for(read(r), rng.uniform(0.01, 0.6))
        except (TimeoutError, asyncio.TimeoutError):
            pass  # leaving the block closes the connection: the disconnect
    assert status in (200, 400), status
    if not any(e.get("event") == "done" for e in events):
        return status, []
    return status, [e["group"]["group_id"] for e in events if e["event"] == "group_finished"]


async def retried(c: httpx.AsyncClient, k: int) -> list[str]:
    """The abandoned call's client comes back with the same `request_id` (not streamed): it
    gets the stored answer if the call had delivered (its lines lost in transit), else the
    call runs again on the groups it had handed in. 400: too few groups available now."""
    body = {
        "groups": [group(f"ab{k}", [k % 50 + 3, 9], [200], ignore_eos=True)],
        "target_groups": 1,
        "request_id": f"abandon-{k}",
    }
    r = await c.post(R + "/rollouts", json=body, timeout=300)
    assert r.status_code in (200, 400), r.text
    return [g["group_id"] for g in r.json()["groups"]] if r.status_code == 200 else []


async def ordinary(c: httpx.AsyncClient, k: int, rng: random.Random) -> dict[str, Any]:
    await asyncio.sleep(rng.uniform(0, 2.0))
    body = {"groups": [group(f"or{k}", [k + 1, 8], [20], ignore_eos=True)], "target_groups": 1}
    r = await c.post(R + "/rollouts", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def listed(c: httpx.AsyncClient) -> list[str]:
    ids: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 25}
        if cursor is not None:
            params["cursor"] = cursor
        r = await c.get(R + "/partials", params=params, timeout=ANSWER_S)
        assert r.status_code == 200, r.text
        page = r.json()
        ids += [g["group_id"] for g in page["groups"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return ids


async def settled(c: httpx.AsyncClient) -> None:
    """Wait until no call runs, asking with a short timeout each time (a hung server fails)."""
    deadline = time.monotonic() + 180
    while True:
        st = (await c.get(R + "/stats", timeout=ANSWER_S)).json()
        if st["active_calls"] == 0 and st["running_samples"] == 0:
            return
        assert time.monotonic() < deadline, st
        await asyncio.sleep(0.5)


def test_abandoned_streams_beside_ordinary_calls_hang_nothing_and_lose_nothing(
    tiny_server: ServerProc,
) -> None:
    async def go() -> None:
        rng = random.Random(23)
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=ANSWER_S) as c:
            with tiny_server.client() as sync:
                clear_buffer(sync)
            buffered = await fill_buffer(c)
            assert len(buffered) == BUFFERED
            results = await asyncio.gather(
                *(abandoned_stream(tiny_server.url, k, rng) for k in range(DISCONNECTS)),
                *(ordinary(c, k, rng) for k in range(ORDINARY)),
            )
            streams, calls = results[:DISCONNECTS], results[DISCONNECTS:]
            accepted = {f"ab{k}" for k, (status, _) in enumerate(streams) if status == 200}
            abandoned = sum(1 for status, got in streams if status == 200 and not got)
            assert abandoned >= DISCONNECTS // 2, streams  # the storm did happen
            delivered = [g["group_id"] for r in calls for g in r["groups"]]
            delivered += [gid for _, got in streams for gid in got]
            await settled(c)  # the abandoned calls wind down on their own
            # Nothing abandoned is lost: asking again with the same request_id says what became
            # of each (delivered before its client left, or still buffered and run now).
            again = [k for k, (status, got) in enumerate(streams) if status == 200 and not got]
            for got in await asyncio.gather(*(retried(c, k) for k in again)):
                delivered += got
            await settled(c)
            ids = await listed(c)
            assert len(ids) == len(set(ids)), "a buffered group is listed twice"
            st = (await c.get(R + "/stats", timeout=ANSWER_S)).json()
            assert len(ids) == st["buffered_groups"]
            sent = buffered | accepted
            sent |= {f"or{k}" for k in range(ORDINARY)}
            assert len(delivered) == len(set(delivered)), "a group was delivered twice"
            assert set(ids) | set(delivered) == sent and not set(ids) & set(delivered)
            # ... and a new call answers promptly.
            t0 = time.monotonic()
            body = {
                "groups": [group("after", [3, 3], [4])],
                "target_groups": 1,
                "resume_first": False,
            }
            r = await c.post(R + "/rollouts", json=body, timeout=ANSWER_S)
            assert r.status_code == 200 and time.monotonic() - t0 < ANSWER_S, r.text
            with tiny_server.client() as sync:
                clear_buffer(sync)

    asyncio.run(go())
