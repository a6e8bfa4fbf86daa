"""The typed client against httpx.MockTransport (and the real routes over ASGI for one path)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import httpx
import pytest

import clients
from clients import (
    AprilClient,
    AsyncAprilClient,
    Conflict,
    InvalidRequest,
    NotFound,
    ProtocolError,
    ServerError,
    TransportError,
    Unauthorized,
)

URL = "http://april.test"


def test_public_api_is_locked() -> None:
    assert clients.__all__ == sorted(clients.__all__)
    assert set(clients.__all__) == {
        "AprilClient", "AprilError", "AsyncAprilClient", "Conflict", "InvalidRequest",
        "NotFound", "ProtocolError", "RequestRejected", "ServerError", "TransportError",
        "Unauthorized",
    }  # fmt: skip


def recorder(status: int = 200, body: Any = None, content: bytes | None = None) -> Any:
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if content is not None:
            return httpx.Response(status, content=content)
        return httpx.Response(status, json=body if body is not None else {})

    return seen, httpx.MockTransport(handler)


STATS = {"buffered_groups": 0}
SAMPLE = {
    "sample_id": "g/0", "group_id": "g", "index": 0, "status": "partial", "prompt_ids": [1],
    "output_ids": [2], "output_logprobs": [-0.1], "segments": [], "max_new_tokens": 4,
    "finish_reason": None,
}  # fmt: skip
GROUP = {"group_id": "g", "samples": [SAMPLE]}
ROLLOUT = {
    "batch_id": "b", "groups": [GROUP], "buffered_group_ids": [],
    "stats": {"wall_s": 0.1, "weight_version": "0", "num_finished_groups": 1,
              "num_buffered_groups": 0, "output_tokens": 1, "offpolicy_tokens": 0,
              "resumed_samples": 0, "restored_kv_tokens": 0, "recomputed_tokens": 0},
}  # fmt: skip


def test_each_method_sends_the_contract_request() -> None:
    cases = [
        (lambda c: c.rollout([{"group_id": "g", "input_ids": [1]}], 1, request_id="r1"),
         "POST", "/april/v1/rollouts", ROLLOUT),
        (lambda c: c.abort(all=True, keep="snapshot"), "POST", "/april/v1/abort", {"samples": []}),
        (lambda c: c.resume(["g/0"], append_ids={"g/0": [5]}, kv="recompute"),
         "POST", "/april/v1/resume", {"samples": [SAMPLE]}),
        (lambda c: c.partials(), "GET", "/april/v1/partials", {"groups": [GROUP]}),
        (lambda c: c.partial("a/b"), "GET", "/april/v1/partials/a%2Fb", GROUP),
        (lambda c: c.delete_partial("g"), "DELETE", "/april/v1/partials/g",
         {"group_id": "g", "deleted": True}),
        (lambda c: c.stats(), "GET", "/april/v1/stats", STATS),
        (lambda c: c.reject("b1", ["g"]), "POST", "/april/v1/rollouts/b1/reject", {}),
        (lambda c: c.generate([1, 2], {"max_new_tokens": 3}), "POST", "/generate", {}),
        (lambda c: c.update_weights_from_disk("/m", "v2"), "POST",
         "/update_weights_from_disk", {"success": True}),
    ]  # fmt: skip
    for call, method, path, body in cases:
        seen, transport = recorder(body=body)
        with AprilClient(URL, transport=transport, api_key="k") as c:
            out = call(c)
        (req,) = seen
        assert (req.method, req.url.raw_path.decode()) == (method, path)
        assert req.headers["authorization"] == "Bearer k"
        assert out is not None
    seen, transport = recorder(body=ROLLOUT)
    with AprilClient(URL, transport=transport) as c:
        resp = c.rollout([{"group_id": "g", "input_ids": [1]}], 1, on_quota="tokens")
    sent = json.loads(seen[0].content)
    assert sent["on_quota"] == "tokens" and sent["groups"][0]["group_id"] == "g"
    assert resp.groups[0].samples[0].output_ids == [2]


@pytest.mark.parametrize(
    ("status", "exc"),
    [(400, InvalidRequest), (422, InvalidRequest), (401, Unauthorized), (404, NotFound),
     (409, Conflict), (500, ServerError)],
)  # fmt: skip
def test_errors_map_to_exceptions(status: int, exc: type[Exception]) -> None:
    body = {"error": {"code": "some_code", "message": "what to fix"}}
    _, transport = recorder(status, body)
    with AprilClient(URL, transport=transport) as c, pytest.raises(exc) as e:
        c.stats()
    if status < 500:
        assert e.value.code == "some_code" and "what to fix" in str(e.value)  # type: ignore[attr-defined]


def test_undecodable_and_non_json_errors() -> None:
    _, transport = recorder(502, content=b"<html>bad gateway</html>")
    with AprilClient(URL, transport=transport) as c, pytest.raises(ServerError):
        c.stats()
    _, transport = recorder(200, content=b"not json")
    with AprilClient(URL, transport=transport) as c, pytest.raises(ProtocolError):
        c.partials()


def test_bad_arguments_fail_before_sending() -> None:
    seen, transport = recorder(body=ROLLOUT)
    with AprilClient(URL, transport=transport) as c, pytest.raises(ValueError):
        c.rollout([{"group_id": "g", "n": "two"}], 1)
    assert seen == []


def test_retries_only_idempotent_calls() -> None:
    calls = {"n": 0}

    def flaky(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] < 3:
            raise httpx.ConnectError("down", request=req)
        return httpx.Response(200, json=STATS)

    with AprilClient(URL, transport=httpx.MockTransport(flaky), retries=3,
                     retry_backoff_s=0) as c:  # fmt: skip
        assert c.stats() == STATS
    assert calls["n"] == 3
    calls["n"] = 0
    with AprilClient(URL, transport=httpx.MockTransport(flaky), retries=3,
                     retry_backoff_s=0) as c:  # fmt: skip
        with pytest.raises(TransportError):
            c.rollout([{"group_id": "g", "input_ids": [1]}], 1)  # no request_id: not retried
    assert calls["n"] == 1


def test_stream_decodes_ndjson_sync_and_async() -> None:
    done = {"event": "done", "batch_id": "b", "buffered_group_ids": [], "stats": ROLLOUT["stats"]}
    lines = json.dumps({"event": "group_finished", "group": GROUP}) + "\n" + json.dumps(done)
    _, transport = recorder(content=lines.encode())
    with AprilClient(URL, transport=transport) as c:
        events = list(c.rollout_stream([{"group_id": "g", "input_ids": [1]}], 1))
    assert [type(e).__name__ for e in events] == ["GroupFinishedEvent", "DoneEvent"]

    async def go() -> list[Any]:
        def handler(req: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=lines.encode())

        async with AsyncAprilClient(URL, transport=httpx.MockTransport(handler)) as c:
            out = [e async for e in c.rollout_stream([{"group_id": "g", "input_ids": [1]}], 1)]
            return out

    got = asyncio.run(go())
    assert [type(e).__name__ for e in got[:2]] == ["GroupFinishedEvent", "DoneEvent"]


def test_import_needs_only_httpx_and_msgspec() -> None:
    code = (
        "import sys\n"
        "for m in ['torch', 'sglang', 'fastapi', 'triton', 'numpy']: sys.modules[m] = None\n"
        "import clients; print(clients.AprilClient.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "AprilClient"
