"""The typed client against httpx.MockTransport: every route, both clients, errors, retries,
NDJSON streaming, and the light import (httpx + msgspec only)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import clients
from april_server.protocol import (
    AbortResp,
    DeleteResp,
    DoneEvent,
    Group,
    GroupFinishedEvent,
    GroupSpec,
    ResumeResp,
    RolloutResp,
)
from clients import (
    AprilClient,
    AprilError,
    AsyncAprilClient,
    Conflict,
    InvalidRequest,
    NotFound,
    ProtocolError,
    RequestRejected,
    ServerError,
    TransportError,
    Unauthorized,
)
from clients._routes import Call, RetryPolicy
from clients.client import DEFAULT_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
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
FINISHED_LINE = json.dumps({"event": "group_finished", "group": GROUP}).encode() + b"\n"
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


def test_public_api_is_locked() -> None:
    assert clients.__all__ == sorted(clients.__all__)
    assert set(clients.__all__) == {
        "AprilClient", "AprilError", "AsyncAprilClient", "AsyncRolloutStream", "Conflict",
        "InvalidRequest", "NotFound", "ProtocolError", "RequestRejected", "RolloutStream",
        "ServerError", "TransportError", "Unauthorized",
    }  # fmt: skip
    for name in clients.__all__:
        assert getattr(clients, name).__module__.startswith("clients.")


# (call, method, raw path, JSON body sent or None, answer, check on the return value)
ROUTES: list[tuple[Callable[[Any], Any], str, str, Any, httpx.Response, Callable[[Any], bool]]] = [
    (lambda c: c.rollout([SPEC, GroupSpec(group_id="h", n=2, seed=7)], 2, on_quota="tokens",
                         max_staleness=1, max_inflight_groups=4, request_id="r1"),
     "POST", "/april/v1/rollouts",
     {"groups": [SPEC, {"group_id": "h", "n": 2, "seed": 7}], "target_groups": 2,
      "on_quota": "tokens", "max_staleness": 1, "max_inflight_groups": 4, "request_id": "r1"},
     answer(body=ROLLOUT),
     lambda r: isinstance(r, RolloutResp) and r.groups[0].samples[0].output_ids == [2]),
    (lambda c: c.rollout([], 3, resume_first=False), "POST", "/april/v1/rollouts",
     {"target_groups": 3, "resume_first": False}, answer(body=ROLLOUT),
     lambda r: r.buffered_group_ids == ["h"]),
    (lambda c: c.reject("b/1", ["g"]), "POST", "/april/v1/rollouts/b%2F1/reject",
     {"group_ids": ["g"]}, answer(body={"batch_id": "b/1", "rejected": ["g"]}),
     lambda r: r == {"batch_id": "b/1", "rejected": ["g"]}),
    (lambda c: c.abort("b1", keep="snapshot"), "POST", "/april/v1/abort",
     {"batch_id": "b1", "keep": "snapshot"}, answer(body={"samples": [SAMPLE]}),
     lambda r: isinstance(r, AbortResp) and r.samples[0].sample_id == "g/0"),
    (lambda c: c.abort(group_ids=["g"], sample_ids=["h/1"], all=True), "POST", "/april/v1/abort",
     {"group_ids": ["g"], "sample_ids": ["h/1"], "all": True}, answer(body={"samples": []}),
     lambda r: r.samples == []),
    (lambda c: c.resume(["g/0"], {"g/0": [5]}, "recompute", {"temperature": 0.5}),
     "POST", "/april/v1/resume",
     {"sample_ids": ["g/0"], "append_ids": {"g/0": [5]}, "kv": "recompute",
      "sampling_params": {"temperature": 0.5}},
     answer(body={"samples": [SAMPLE]}), lambda r: isinstance(r, ResumeResp)),
    (lambda c: c.resume(["g/0"]), "POST", "/april/v1/resume", {"sample_ids": ["g/0"]},
     answer(body={"samples": []}), lambda r: r.samples == []),
    (lambda c: c.partials(), "GET", "/april/v1/partials", None, answer(body={"groups": [GROUP]}),
     lambda r: isinstance(r, list) and isinstance(r[0], Group) and r[0].group_id == "g"),
    (lambda c: c.partials_page(50, "7", status="partial", min_age_s=1.5, weight_version="v 2"),
     "GET", "/april/v1/partials?limit=50&cursor=7&status=partial&min_age_s=1.5&weight_version=v+2",
     None, answer(body={"groups": [GROUP], "next_cursor": "9"}),
     lambda r: r.next_cursor == "9" and r.groups[0].group_id == "g"),
    (lambda c: c.partial("a/b"), "GET", "/april/v1/partials/a%2Fb", None, answer(body=GROUP),
     lambda r: isinstance(r, Group)),
    (lambda c: c.delete_partial("g"), "DELETE", "/april/v1/partials/g", None,
     answer(body={"group_id": "g", "deleted": True}),
     lambda r: isinstance(r, DeleteResp) and r.deleted),
    (lambda c: c.stats(), "GET", "/april/v1/stats", None,
     answer(body={"buffered_groups": 2, "engine": {"x": 1}}),
     lambda r: r == {"buffered_groups": 2, "engine": {"x": 1}}),
    (lambda c: c.metrics(), "GET", "/metrics", None,
     answer(content=b"# TYPE april_x counter\napril_x 3\n"), lambda r: r.endswith("april_x 3\n")),
    (lambda c: c.health(), "GET", "/health", None, answer(content=b""), lambda r: r is True),
    (lambda c: c.flush_cache(), "POST", "/flush_cache", None,
     answer(content=b"Cache flushed.\n"), lambda r: r is None),
    (lambda c: c.generate([1, 2], {"max_new_tokens": 3}, return_logprob=True),
     "POST", "/generate",
     {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True},
     answer(body={"text": "x", "meta_info": {}}), lambda r: r["text"] == "x"),
    (lambda c: c.update_weights_from_disk("/m", "v2", flush_cache=False),
     "POST", "/update_weights_from_disk",
     {"model_path": "/m", "weight_version": "v2", "flush_cache": False},
     answer(body={"success": True, "message": "ok"}), lambda r: r["success"] is True),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(ROUTES)))
def test_each_method_sends_the_contract_request(case: int) -> None:
    call, method, path, body, response, check = ROUTES[case]
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(response.status_code, content=response.content)

    for out in both(handler, call, api_key="k"):
        assert check(out), out
    assert len(seen) == 2  # one per client, same request
    for req in seen:
        assert (req.method, req.url.raw_path.decode()) == (method, path)
        assert req.headers["authorization"] == "Bearer k"
        if body is None:
            assert req.content == b""
        else:
            assert req.headers["content-type"] == "application/json"
            assert json.loads(req.content) == body


def test_partials_walks_every_page_with_its_filters() -> None:
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.raw_path.decode())
        nxt = {None: "3", "3": "8", "8": None}[req.url.params.get("cursor")]
        g = {**GROUP, "group_id": f"g{len(seen)}"}
        return answer(body={"groups": [g], "next_cursor": nxt})

    for out in both(handler, lambda c: c.partials(status="finished")):
        assert [g.group_id for g in out] in (["g1", "g2", "g3"], ["g4", "g5", "g6"])
    assert seen[:3] == [
        "/april/v1/partials?status=finished",
        "/april/v1/partials?cursor=3&status=finished",
        "/april/v1/partials?cursor=8&status=finished",
    ]


def test_no_api_key_sends_no_authorization_header() -> None:
    seen, handler = recorder(body={})
    both(handler, lambda c: c.stats())
    assert all("authorization" not in r.headers for r in seen)


def test_constructor_checks_and_long_read_timeout() -> None:
    with pytest.raises(ValueError, match="base_url"):
        AprilClient("localhost:30000")
    with pytest.raises(ValueError, match="api_key"):
        AprilClient(URL, api_key="")
    with pytest.raises(ValueError, match="retries"):
        AprilClient(URL, retries=-1)
    with pytest.raises(ValueError, match="retries"):
        AsyncAprilClient(URL, retries=1000)
    assert DEFAULT_TIMEOUT.read is not None and DEFAULT_TIMEOUT.read >= 600
    with AprilClient(URL + "/") as c:
        assert c.base_url == URL
        assert c._http.timeout == DEFAULT_TIMEOUT


ERROR_CASES = [
    (400, InvalidRequest), (401, Unauthorized), (403, Unauthorized), (404, NotFound),
    (409, Conflict), (413, RequestRejected), (422, InvalidRequest), (500, ServerError),
    (503, ServerError),
]  # fmt: skip


@pytest.mark.parametrize(("status", "exc"), ERROR_CASES)
def test_contract_errors_map_to_exceptions(status: int, exc: type[Exception]) -> None:
    body = {"error": {"code": "some_code", "message": "what to fix"}}
    _, handler = recorder(status, body)
    for err in both_raise(handler, lambda c: c.partial("g")):
        assert type(err) is exc
        assert isinstance(err, RequestRejected) == (status < 500)
        assert (err.status_code, err.code, err.message) == (status, "some_code", "what to fix")  # type: ignore[attr-defined]
        assert "what to fix" in str(err) and "/april/v1/partials/g" in str(err)


def test_other_error_bodies_still_map_by_status() -> None:
    _, handler = recorder(502, content=b"<html>bad gateway</html>")
    for err in both_raise(handler, lambda c: c.stats()):
        assert isinstance(err, ServerError)
        assert (err.code, err.message) == ("http_502", "<html>bad gateway</html>")
    # SGLang's native routes answer {"success": false, "message": ...}; FastAPI {"detail": ...}.
    _, handler = recorder(400, {"success": False, "message": "no such path"})
    for err in both_raise(handler, lambda c: c.update_weights_from_disk("/nope")):
        assert isinstance(err, InvalidRequest) and err.message == "no such path"
    _, handler = recorder(422, {"detail": [{"loc": ["body"], "msg": "bad"}]})
    for err in both_raise(handler, lambda c: c.generate([1])):
        assert isinstance(err, InvalidRequest) and '"msg":"bad"' in err.message
    _, handler = recorder(503, content=b"")
    for err in both_raise(handler, lambda c: c.stats()):
        assert isinstance(err, ServerError) and err.message == "Service Unavailable"
    _, handler = recorder(307, content=b"")
    for err in both_raise(handler, lambda c: c.stats()):
        assert isinstance(err, ProtocolError)


def test_undecodable_success_is_a_protocol_error() -> None:
    for content in (b"not json", b'{"groups": [{"group_id": 3}]}', b'{"nope": 1}'):
        _, handler = recorder(200, content=content)
        for err in both_raise(handler, lambda c: c.partials()):
            assert isinstance(err, ProtocolError), err


def test_transport_failure_wraps_the_httpx_error() -> None:
    def down(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    for err in both_raise(down, lambda c: c.stats()):
        assert isinstance(err, TransportError)
        assert isinstance(err.cause, httpx.ConnectError) and err.__cause__ is err.cause
        assert "connection refused" in str(err)


def test_health_is_false_while_starting_or_down_and_raises_on_auth() -> None:
    _, starting = recorder(503, content=b"")
    assert both(starting, lambda c: c.health()) == [False, False]

    def down(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    assert both(down, lambda c: c.health()) == [False, False]
    _, denied = recorder(401, content=b"")
    assert all(isinstance(e, Unauthorized) for e in both_raise(denied, lambda c: c.health()))


BAD_ARGUMENTS: list[Callable[[Any], Any]] = [
    lambda c: c.rollout([{"group_id": "g", "n": "two"}], 1),
    lambda c: c.rollout([{"group_id": "g", "input_id": [1]}], 1),  # typo: unknown field
    lambda c: c.rollout([{"n": 2}], 1),  # no group_id
    lambda c: c.rollout({"group_id": "g"}, 1),  # one dict, not a list
    lambda c: c.rollout([42], 1),
    lambda c: c.rollout([SPEC], 1, on_quota="keep"),
    lambda c: c.rollout([GroupSpec(group_id="g", input_ids=["a"])], 1),  # type: ignore[list-item]
    lambda c: c.rollout([{"group_id": "g", "input_ids": [object()]}], 1),
    lambda c: c.resume("g/0"),  # a string, not a list of ids
    lambda c: c.abort(keep="all"),
    lambda c: c.generate([1], stream=True),
]


@pytest.mark.parametrize("case", range(len(BAD_ARGUMENTS)))
def test_bad_arguments_fail_before_sending(case: int) -> None:
    seen, handler = recorder(body=ROLLOUT)
    with AprilClient(URL, transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(ValueError) as e:
            BAD_ARGUMENTS[case](c)
    assert not isinstance(e.value, AprilError)
    assert seen == []


def test_bad_group_dict_error_names_the_group() -> None:
    with AprilClient(URL) as c, pytest.raises(ValueError, match=r"groups\[1\].*input_id"):
        c.rollout([SPEC, {"group_id": "h", "input_id": [1]}], 1)


# ---- retries ---------------------------------------------------------------------------------


def flaky(failures: int, fail: Callable[[httpx.Request], httpx.Response], ok: Any) -> Any:
    """A handler that fails `failures` times (per client) then answers `ok`; counts calls."""
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.url.path)
        if len(calls) <= failures:
            return fail(req)
        return answer(body=ok)

    return calls, handler


def refuse(req: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("refused", request=req)


def unavailable(req: httpx.Request) -> httpx.Response:
    return answer(503, {"error": {"code": "overloaded", "message": "try later"}})


IDEMPOTENT: list[tuple[Callable[[Any], Any], Any]] = [
    (lambda c: c.stats(), {}),
    (lambda c: c.partials(), {"groups": []}),
    (lambda c: c.partial("g"), GROUP),
    (lambda c: c.metrics(), {}),
    (lambda c: c.abort(all=True), {"samples": []}),
    (lambda c: c.rollout([SPEC], 1, request_id="step-1"), ROLLOUT),
]
NOT_IDEMPOTENT: list[Callable[[Any], Any]] = [
    lambda c: c.rollout([SPEC], 1),  # no request_id
    lambda c: c.resume(["g/0"]),
    lambda c: c.reject("b", ["g"]),
    lambda c: c.delete_partial("g"),
    lambda c: c.generate([1]),
    lambda c: c.update_weights_from_disk("/m"),
    lambda c: c.flush_cache(),
]


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("fail", [refuse, unavailable])
@pytest.mark.parametrize("case", range(len(IDEMPOTENT)))
def test_idempotent_calls_are_retried(case: int, fail: Handler, run: Any) -> None:
    call, ok = IDEMPOTENT[case]
    calls, handler = flaky(2, fail, ok)
    assert run(handler, call, retries=2, retry_backoff_s=0) is not None
    assert len(calls) == 3


@pytest.mark.parametrize("run", RUNNERS)
@pytest.mark.parametrize("case", range(len(NOT_IDEMPOTENT)))
def test_other_calls_are_never_retried(case: int, run: Any) -> None:
    calls, handler = flaky(1, refuse, {})
    with pytest.raises(TransportError):
        run(handler, NOT_IDEMPOTENT[case], retries=3, retry_backoff_s=0)
    assert len(calls) == 1


@pytest.mark.parametrize("run", RUNNERS)
def test_retries_are_bounded_logged_and_reraise_the_last_error(
    run: Any, caplog: pytest.LogCaptureFixture
) -> None:
    calls, handler = flaky(100, unavailable, {})
    caplog.set_level(logging.WARNING, logger="clients")
    with pytest.raises(ServerError) as e:
        run(handler, lambda c: c.rollout([SPEC], 1, request_id="step-9"), retries=2,
            retry_backoff_s=0)  # fmt: skip
    assert e.value.code == "overloaded"
    assert len(calls) == 3  # the call and two retries
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all("rid=step-9" in m and "ServerError" in m and "try later" in m for m in warnings)


@pytest.mark.parametrize("run", RUNNERS)
def test_client_errors_are_not_retried(run: Any) -> None:
    calls, handler = flaky(100, lambda r: answer(404, {"error": {"code": "c", "message": "m"}}), {})
    with pytest.raises(NotFound):
        run(handler, lambda c: c.stats(), retries=3, retry_backoff_s=0)
    assert len(calls) == 1


def test_retry_backoff_doubles_and_is_capped() -> None:
    policy = RetryPolicy(retries=3, backoff_s=20)
    call = Call("GET", "/x", bytes, idempotent=True)
    err = TransportError(httpx.ConnectError("x"))
    assert [policy.next_delay(call, err, k) for k in range(4)] == [20, 30, 30, None]
    assert RetryPolicy(retries=3, backoff_s=1).next_delay(call, err, 1) == 2


# ---- streaming -------------------------------------------------------------------------------


class Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body delivered in the given chunks, recording whether it was closed."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.sent = 0
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self.sent += 1
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.sent += 1
            yield chunk

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i : i + n] for i in range(0, len(data), n)]


def stream_both(handler: Handler, **kw: Any) -> list[tuple[list[Any], Any]]:
    """Consume a rollout stream with both clients; returns (events, stream object) for each."""
    with AprilClient(URL, transport=httpx.MockTransport(handler), **kw) as c:
        s = c.rollout_stream([SPEC], 2, request_id="r")
        out = [(list(s), s)]

    async def go() -> tuple[list[Any], Any]:
        async with AsyncAprilClient(URL, transport=httpx.MockTransport(handler), **kw) as ac:
            s = ac.rollout_stream([SPEC], 2, request_id="r")
            return [e async for e in s], s

    return [*out, asyncio.run(go())]


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
def test_stream_decodes_ndjson_split_anywhere(chunk_size: int) -> None:
    body = FINISHED_LINE + b"\n" + FINISHED_LINE + DONE_LINE.rstrip(b"\n")  # blank line, no EOL
    seen: list[httpx.Request] = []
    streams: list[Chunks] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        streams.append(Chunks(split_every(body, chunk_size)))
        return httpx.Response(200, stream=streams[-1])

    for events, s in stream_both(handler):
        assert [type(e) for e in events] == [GroupFinishedEvent, GroupFinishedEvent, DoneEvent]
        assert [g.group_id for g in s.groups] == ["g", "g"]
        assert s.batch_id == "b" and s.done is events[-1]
    assert all(st.closed for st in streams)
    for req in seen:
        assert (req.method, req.url.path) == ("POST", "/april/v1/rollouts")
        assert json.loads(req.content) == {
            "groups": [SPEC], "target_groups": 2, "stream": True, "request_id": "r",
        }  # fmt: skip


def test_stream_closed_early_closes_the_response() -> None:
    streams: list[Chunks] = []

    def handler(req: httpx.Request) -> httpx.Response:
        streams.append(Chunks([FINISHED_LINE, FINISHED_LINE, FINISHED_LINE, DONE_LINE]))
        return httpx.Response(200, stream=streams[-1])

    with AprilClient(URL, transport=httpx.MockTransport(handler)) as c:
        with c.rollout_stream([SPEC], 3) as s:
            assert isinstance(next(s), GroupFinishedEvent)
        assert streams[0].closed and streams[0].sent == 1
        assert list(s) == [] and s.batch_id is None

    async def go() -> None:
        async with AsyncAprilClient(URL, transport=httpx.MockTransport(handler)) as ac:
            async with ac.rollout_stream([SPEC], 3) as s:
                async for _ in s:
                    break
            assert streams[1].closed and streams[1].sent == 1

    asyncio.run(go())


def test_stream_error_before_the_first_event() -> None:
    _, handler = recorder(422, {"error": {"code": "invalid_schema", "message": "bad n"}})
    with AprilClient(URL, transport=httpx.MockTransport(handler)) as c:
        s = c.rollout_stream([SPEC], 1)  # nothing sent yet
        with pytest.raises(InvalidRequest, match="bad n"):
            next(s)

    async def go() -> None:
        async with AsyncAprilClient(URL, transport=httpx.MockTransport(handler)) as ac:
            with pytest.raises(InvalidRequest, match="bad n"):
                [e async for e in ac.rollout_stream([SPEC], 1)]

    asyncio.run(go())


@pytest.mark.parametrize(
    ("body", "match"),
    [(FINISHED_LINE, "before its done"), (FINISHED_LINE + b"{oops}\n", "bad event line"),
     (b'{"event": "started"}\n', "bad event line"), (DONE_LINE + FINISHED_LINE, "after its done")],
)  # fmt: skip
def test_broken_streams_are_protocol_errors(body: bytes, match: str) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Chunks([body]))

    with AprilClient(URL, transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(ProtocolError, match=match):
            list(c.rollout_stream([SPEC], 1))

    async def go() -> None:
        async with AsyncAprilClient(URL, transport=httpx.MockTransport(handler)) as ac:
            with pytest.raises(ProtocolError, match=match):
                [e async for e in ac.rollout_stream([SPEC], 1)]

    asyncio.run(go())


def test_stream_open_is_retried_only_with_a_request_id() -> None:
    def handler_for(calls: list[int]) -> Handler:
        def handler(req: httpx.Request) -> httpx.Response:
            calls.append(1)
            if len(calls) == 1:
                return unavailable(req)
            return httpx.Response(200, stream=Chunks([FINISHED_LINE, DONE_LINE]))

        return handler

    sync_calls: list[int] = []
    with AprilClient(URL, transport=httpx.MockTransport(handler_for(sync_calls)), retries=1,
                     retry_backoff_s=0) as c:  # fmt: skip
        assert len(list(c.rollout_stream([SPEC], 1, request_id="r"))) == 2
        with pytest.raises(ServerError):
            sync_calls.clear()
            list(c.rollout_stream([SPEC], 1))  # no request_id: not retried
    async_calls: list[int] = []

    async def go() -> int:
        async with AsyncAprilClient(URL, transport=httpx.MockTransport(handler_for(async_calls)),
                                    retries=1, retry_backoff_s=0) as ac:  # fmt: skip
            return len([e async for e in ac.rollout_stream([SPEC], 1, request_id="r")])

    assert asyncio.run(go()) == 2 and len(async_calls) == 2


# ---- packaging -------------------------------------------------------------------------------


def test_import_needs_only_httpx_and_msgspec() -> None:
    heavy = ["torch", "sglang", "fastapi", "uvicorn", "starlette", "triton", "numpy", "pydantic"]
    code = (
        "import sys\n"
        f"for m in {heavy!r}: sys.modules[m] = None\n"
        "import clients, clients.client\n"
        "print(clients.AprilClient.__name__, clients.AsyncAprilClient.__name__)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AprilClient", "AsyncAprilClient"]
