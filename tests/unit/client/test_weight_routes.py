"""The weight routes of both clients against httpx.MockTransport: what each sends, what it
refuses before sending, and how the group info decodes (`_weight_routes.py`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from april_client import AprilClient, AsyncAprilClient
from april_client.protocol import WeightGroupInfo

URL = "http://server:30000"


def recorder() -> tuple[list[tuple[str, str, Any]], httpx.MockTransport]:
    seen: list[tuple[str, str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, body))
        if request.url.path == "/april/v1/weights/group":
            return httpx.Response(
                200,
                json={
                    "ranks": 2,
                    "weight_version": "3",
                    "group": "g",
                    "world_size": 3,
                    "in_sync": False,
                    "behind": ["e1"],
                },
            )
        return httpx.Response(200, json={"success": True, "message": "ok"})

    return seen, httpx.MockTransport(handler)


def test_the_sync_client_sends_sglangs_weight_routes() -> None:
    seen, transport = recorder()
    with AprilClient(URL, transport=transport) as c:
        info = c.weight_group()
        assert info == WeightGroupInfo(2, "3", "g", 3, False, ["e1"])
        c.init_weights_update_group("10.0.0.5", 29500, 3, "g", "gloo")
        c.begin_weight_update()
        c.update_weights_from_distributed(
            ["w", "b"], ["float32", "bfloat16"], [[2, 3], [3]], "g", weight_version="7"
        )
        c.end_weight_update()
        c.destroy_weights_update_group("g")
    assert seen[1:] == [
        (
            "POST",
            "/init_weights_update_group",
            {
                "master_address": "10.0.0.5",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 3,
                "group_name": "g",
                "backend": "gloo",
            },
        ),
        ("POST", "/begin_weight_update", {}),
        (
            "POST",
            "/update_weights_from_distributed",
            {
                "names": ["w", "b"],
                "dtypes": ["float32", "bfloat16"],
                "shapes": [[2, 3], [3]],
                "group_name": "g",
                "weight_version": "7",
            },
        ),
        ("POST", "/end_weight_update", {}),
        ("POST", "/destroy_weights_update_group", {"group_name": "g"}),
    ]


def test_the_async_client_sends_the_same() -> None:
    seen, transport = recorder()

    async def go() -> None:
        async with AsyncAprilClient(
            URL, transport=httpx.MockTransport(transport.handle_request)
        ) as c:  # type: ignore[arg-type]
            assert (await c.weight_group()).behind == ["e1"]
            await c.init_weights_update_group("h", 1, 2, rank_offset=1)
            await c.update_weights_from_distributed(["w"], ["float32"], [[1]])

    asyncio.run(go())
    assert [p for _, p, _ in seen] == [
        "/april/v1/weights/group",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
    ]
    assert seen[1][2]["backend"] == "nccl" and seen[2][2]["group_name"] == "weight_update_group"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c: c.init_weights_update_group("h", 1, 1), "world_size"),
        (lambda c: c.init_weights_update_group("h", 1, 3, rank_offset=3), "rank_offset"),
        (lambda c: c.update_weights_from_distributed([], [], []), "at least one"),
        (lambda c: c.update_weights_from_distributed(["a", "b"], ["f"], [[1]]), "one of each"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(call: Any, match: str) -> None:
    seen, transport = recorder()
    with AprilClient(URL, transport=transport) as c, pytest.raises(ValueError, match=match):
        call(c)
    assert seen == []
