"""The typed client against httpx.MockTransport: every route on both clients, the constructor,
and how errors map to exceptions (retries: test_retries.py; NDJSON streaming:
test_stream.py; import paths: test_imports.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import april_client
from april_client import (
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
from april_client.client import DEFAULT_TIMEOUT
from april_client.protocol import (
    AbortResp,
    DeleteResp,
    Group,
    GroupSpec,
    GroupsResp,
    ResumeResp,
    RolloutResp,
)
from tests.unit.client.client_fakes import (
    GROUP,
    ROLLOUT,
    SAMPLE,
    SPEC,
    URL,
    answer,
    both,
    both_raise,
    recorder,
)


def test_public_api_is_locked() -> None:
    assert april_client.__all__ == sorted(april_client.__all__)
    assert set(april_client.__all__) == {
        "AprilClient",
        "AprilError",
        "AsyncAprilClient",
        "AsyncRolloutStream",
        "Conflict",
        "InvalidRequest",
        "NotFound",
        "ProtocolError",
        "RequestRejected",
        "RolloutStream",
        "ServerError",
        "TransportError",
        "Unauthorized",
    }
    for name in april_client.__all__:
        assert getattr(april_client, name).__module__.startswith("april_client.")


# (call, method, raw path, JSON body sent or None, answer, check on the return value)
ROUTES: list[tuple[Callable[[Any], Any], str, str, Any, httpx.Response, Callable[[Any], bool]]] = [
    (
        lambda c: c.rollout(
            [SPEC, GroupSpec(group_id="h", n=2, seed=7)],
            2,
            on_quota="tokens",
            max_staleness=1,
            max_inflight_groups=4,
            request_id="r1",
        ),
        "POST",
        "/april/v1/rollouts",
        {
            "groups": [SPEC, {"group_id": "h", "n": 2, "seed": 7}],
            "target_groups": 2,
            "on_quota": "tokens",
            "max_staleness": 1,
            "max_inflight_groups": 4,
            "request_id": "r1",
        },
        answer(body=ROLLOUT),
        lambda r: isinstance(r, RolloutResp) and r.groups[0].samples[0].output_ids == [2],
    ),
    (
        lambda c: c.rollout([], 3, resume_first=False),
        "POST",
        "/april/v1/rollouts",
        {"target_groups": 3, "resume_first": False},
        answer(body=ROLLOUT),
        lambda r: r.buffered_group_ids == ["h"],
    ),
    (
        lambda c: c.rollout([SPEC], 1, on_quota="continue"),
        "POST",
        "/april/v1/rollouts",
        {"groups": [SPEC], "on_quota": "continue"},
        answer(body=ROLLOUT),
        lambda r: isinstance(r, RolloutResp),
    ),
    (
        lambda c: c.add_groups([SPEC], request_id="p1"),
        "POST",
        "/april/v1/groups",
        {"groups": [SPEC], "request_id": "p1"},
        answer(body={"group_ids": ["g"], "started_samples": 1}),
        lambda r: isinstance(r, GroupsResp) and r.started_samples == 1,
    ),
    (
        lambda c: c.add_groups([SPEC], start="idle"),
        "POST",
        "/april/v1/groups",
        {"groups": [SPEC], "start": "idle"},
        answer(body={"group_ids": ["g"], "started_samples": 0}),
        lambda r: r.group_ids == ["g"],
    ),
    (
        lambda c: c.reject("b/1", ["g"]),
        "POST",
        "/april/v1/rollouts/b%2F1/reject",
        {"group_ids": ["g"]},
        answer(body={"batch_id": "b/1", "rejected": ["g"]}),
        lambda r: r == {"batch_id": "b/1", "rejected": ["g"]},
    ),
    (
        lambda c: c.abort("b1", keep="snapshot"),
        "POST",
        "/april/v1/abort",
        {"batch_id": "b1", "keep": "snapshot"},
        answer(body={"samples": [SAMPLE]}),
        lambda r: isinstance(r, AbortResp) and r.samples[0].sample_id == "g/0",
    ),
    (
        lambda c: c.abort(group_ids=["g"], sample_ids=["h/1"], all=True),
        "POST",
        "/april/v1/abort",
        {"group_ids": ["g"], "sample_ids": ["h/1"], "all": True},
        answer(body={"samples": []}),
        lambda r: r.samples == [],
    ),
    (
        lambda c: c.resume(["g/0"], {"g/0": [5]}, "recompute", {"temperature": 0.5}),
        "POST",
        "/april/v1/resume",
        {
            "sample_ids": ["g/0"],
            "append_ids": {"g/0": [5]},
            "kv": "recompute",
            "sampling_params": {"temperature": 0.5},
        },
        answer(body={"samples": [SAMPLE]}),
        lambda r: isinstance(r, ResumeResp),
    ),
    (
        lambda c: c.resume(["g/0"]),
        "POST",
        "/april/v1/resume",
        {"sample_ids": ["g/0"]},
        answer(body={"samples": []}),
        lambda r: r.samples == [],
    ),
    (
        lambda c: c.partials(),
        "GET",
        "/april/v1/partials",
        None,
        answer(body={"groups": [GROUP]}),
        lambda r: isinstance(r, list) and isinstance(r[0], Group) and r[0].group_id == "g",
    ),
    (
        lambda c: c.partials_page(50, "7", status="partial", min_age_s=1.5, weight_version="v 2"),
        "GET",
        "/april/v1/partials?limit=50&cursor=7&status=partial&min_age_s=1.5&weight_version=v+2",
        None,
        answer(body={"groups": [GROUP], "next_cursor": "9"}),
        lambda r: r.next_cursor == "9" and r.groups[0].group_id == "g",
    ),
    (
        lambda c: c.partial("a/b"),
        "GET",
        "/april/v1/partials/a%2Fb",
        None,
        answer(body=GROUP),
        lambda r: isinstance(r, Group),
    ),
    (
        lambda c: c.delete_partial("g"),
        "DELETE",
        "/april/v1/partials/g",
        None,
        answer(body={"group_id": "g", "deleted": True}),
        lambda r: isinstance(r, DeleteResp) and r.deleted,
    ),
    (
        lambda c: c.stats(),
        "GET",
        "/april/v1/stats",
        None,
        answer(body={"buffered_groups": 2, "engine": {"x": 1}}),
        lambda r: r == {"buffered_groups": 2, "engine": {"x": 1}},
    ),
    (
        lambda c: c.metrics(),
        "GET",
        "/metrics",
        None,
        answer(content=b"# TYPE april_x counter\napril_x 3\n"),
        lambda r: r.endswith("april_x 3\n"),
    ),
    (lambda c: c.health(), "GET", "/health", None, answer(content=b""), lambda r: r is True),
    (
        lambda c: c.flush_cache(),
        "POST",
        "/flush_cache",
        None,
        answer(content=b"Cache flushed.\n"),
        lambda r: r is None,
    ),
    (
        lambda c: c.generate([1, 2], {"max_new_tokens": 3}, return_logprob=True),
        "POST",
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True},
        answer(body={"text": "x", "meta_info": {}}),
        lambda r: r["text"] == "x",
    ),
    (
        lambda c: c.update_weights_from_disk("/m", "v2", flush_cache=False),
        "POST",
        "/update_weights_from_disk",
        {"model_path": "/m", "weight_version": "v2", "flush_cache": False},
        answer(body={"success": True, "message": "ok"}),
        lambda r: r["success"] is True,
    ),
]


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
