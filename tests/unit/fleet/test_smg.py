"""`april_server.fleet.smg` against answers captured from the real smg 1.13.0.

Every JSON body below was returned by `smg launch` (PyPI smg 1.13.0, CPU, 127.0.0.1) in front of
a stdlib fake SGLang worker, and is pasted verbatim on one line; the tests replay it through
`httpx.MockTransport`, so no smg is needed here.
"""
# ruff: noqa: E501  (the captured smg answers are pasted verbatim, one line each)

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from april_server.fleet.smg import SmgError, SmgWorker, parse_workers, smg_register, smg_workers

GATEWAY = "http://smg.test:30000"

# `smg launch --worker-urls http://127.0.0.1:18001 --enable-rl`, fake SGLang worker up.
WORKERS_READY = r"""{"workers":[{"id":"01a23dcb-7560-74e5-b1a4-935be8293531","model_id":"Qwen/Qwen2.5-0.5B-Instruct","url":"http://127.0.0.1:18001","models":[{"id":"Qwen/Qwen2.5-0.5B-Instruct","model_type":["chat","completions","responses","tools"],"hf_model_type":"qwen2","architectures":["Qwen2ForCausalLM"],"context_length":32768,"tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct"}],"worker_type":"regular","connection_mode":"http","runtime_type":"sglang","labels":{"max_running_requests":"256","context_length":"32768","tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct","dp_size":"1","model_path":"Qwen/Qwen2.5-0.5B-Instruct","is_generation":"true","version":"0.5.23","has_audio_understanding":"false","architectures":"[\"Qwen2ForCausalLM\"]","has_image_understanding":"false","max_model_len":"32768","pp_size":"1","tp_size":"1","served_model_name":"Qwen/Qwen2.5-0.5B-Instruct","model_type":"qwen2"},"priority":50,"cost":1.0,"max_connection_attempts":20,"is_healthy":true,"status":"ready","load":0,"http2":false}],"total":1,"stats":{"prefill_count":0,"decode_count":0,"regular_count":1}}"""

# 5 s after the worker was killed (3 failed probes at a 2 s interval); re-serialised
# by the capture script's json.dump, content as received.
WORKERS_NOT_READY = r"""{"workers": [{"id": "01a23dcc-5a8e-7592-96cf-d7c8da40e086", "model_id": "Qwen/Qwen2.5-0.5B-Instruct", "url": "http://127.0.0.1:18002", "models": [{"id": "Qwen/Qwen2.5-0.5B-Instruct", "model_type": ["chat", "completions", "responses", "tools"], "hf_model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "context_length": 32768, "tokenizer_path": "Qwen/Qwen2.5-0.5B-Instruct"}], "worker_type": "regular", "connection_mode": "http", "runtime_type": "sglang", "labels": {"max_running_requests": "256", "has_audio_understanding": "false", "model_type": "qwen2", "model_path": "Qwen/Qwen2.5-0.5B-Instruct", "max_model_len": "32768", "pp_size": "1", "is_generation": "true", "served_model_name": "Qwen/Qwen2.5-0.5B-Instruct", "version": "0.5.23", "tokenizer_path": "Qwen/Qwen2.5-0.5B-Instruct", "tp_size": "1", "context_length": "32768", "dp_size": "1", "has_image_understanding": "false", "architectures": "[\"Qwen2ForCausalLM\"]"}, "priority": 50, "cost": 1.0, "max_connection_attempts": 20, "is_healthy": false, "status": "not_ready", "load": 0, "http2": false}], "total": 1, "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 1}}"""

# `--health-failure-threshold 1 --health-check-interval-secs 1`, ~4 s after the worker was
# killed.
WORKERS_FAILED = r"""{"workers":[{"id":"01a23dd0-dedc-716c-9358-7becd285c9b1","model_id":"Qwen/Qwen2.5-0.5B-Instruct","url":"http://127.0.0.1:18021","models":[{"id":"Qwen/Qwen2.5-0.5B-Instruct","model_type":["chat","completions","responses","tools"],"hf_model_type":"qwen2","architectures":["Qwen2ForCausalLM"],"context_length":32768,"tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct"}],"worker_type":"regular","connection_mode":"http","runtime_type":"sglang","labels":{"model_type":"qwen2","max_running_requests":"256","has_image_understanding":"false","pp_size":"1","model_path":"Qwen/Qwen2.5-0.5B-Instruct","version":"0.5.23","tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct","has_audio_understanding":"false","served_model_name":"Qwen/Qwen2.5-0.5B-Instruct","is_generation":"true","context_length":"32768","max_model_len":"32768","architectures":"[\"Qwen2ForCausalLM\"]","tp_size":"1","dp_size":"1"},"priority":50,"cost":1.0,"max_connection_attempts":20,"is_healthy":false,"status":"failed","load":0,"http2":false}],"total":1,"stats":{"prefill_count":0,"decode_count":0,"regular_count":1}}"""

# Right after `DELETE /workers/{id}`; registered with labels {"april.role": "engine"}.
WORKERS_DRAINING = r"""{"workers":[{"id":"01a23dce-dfcd-7507-9069-de1619a1fe41","model_id":"Qwen/Qwen2.5-0.5B-Instruct","url":"http://127.0.0.1:18001","models":[{"id":"Qwen/Qwen2.5-0.5B-Instruct","model_type":["chat","completions","responses","tools"],"hf_model_type":"qwen2","architectures":["Qwen2ForCausalLM"],"context_length":32768,"tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct"}],"worker_type":"regular","connection_mode":"http","runtime_type":"sglang","labels":{"has_image_understanding":"false","version":"0.5.23","dp_size":"1","pp_size":"1","has_audio_understanding":"false","tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct","april.role":"engine","model_path":"Qwen/Qwen2.5-0.5B-Instruct","is_generation":"true","context_length":"32768","max_running_requests":"256","tp_size":"1","architectures":"[\"Qwen2ForCausalLM\"]","max_model_len":"32768","model_type":"qwen2","served_model_name":"Qwen/Qwen2.5-0.5B-Instruct"},"priority":50,"cost":1.0,"max_connection_attempts":20,"is_healthy":false,"status":"draining","load":0,"http2":false}],"total":1,"stats":{"prefill_count":0,"decode_count":0,"regular_count":1}}"""

# The same server POSTed as `http://127.0.0.1:18011/` and as `http://127.0.0.1:18011`.
WORKERS_TWO_URL_SPELLINGS = r"""{"workers":[{"id":"01a23dd0-a48e-76f2-8131-7cfadcfd6cfc","model_id":"Qwen/Qwen2.5-0.5B-Instruct","url":"http://127.0.0.1:18011/","models":[{"id":"Qwen/Qwen2.5-0.5B-Instruct","model_type":["chat","completions","responses","tools"],"hf_model_type":"qwen2","architectures":["Qwen2ForCausalLM"],"context_length":32768,"tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct"}],"worker_type":"regular","connection_mode":"http","runtime_type":"sglang","labels":{"has_image_understanding":"false","model_type":"qwen2","served_model_name":"Qwen/Qwen2.5-0.5B-Instruct","tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct","context_length":"32768","dp_size":"1","model_path":"Qwen/Qwen2.5-0.5B-Instruct","architectures":"[\"Qwen2ForCausalLM\"]","max_running_requests":"256","version":"0.5.23","pp_size":"1","is_generation":"true","has_audio_understanding":"false","tp_size":"1","max_model_len":"32768"},"priority":50,"cost":1.0,"max_connection_attempts":20,"is_healthy":true,"status":"ready","load":0,"http2":false},{"id":"01a23dd0-a6a2-75c2-836c-431af083e1ef","model_id":"Qwen/Qwen2.5-0.5B-Instruct","url":"http://127.0.0.1:18011","models":[{"id":"Qwen/Qwen2.5-0.5B-Instruct","model_type":["chat","completions","responses","tools"],"hf_model_type":"qwen2","architectures":["Qwen2ForCausalLM"],"context_length":32768,"tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct"}],"worker_type":"regular","connection_mode":"http","runtime_type":"sglang","labels":{"tp_size":"1","architectures":"[\"Qwen2ForCausalLM\"]","is_generation":"true","max_model_len":"32768","tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct","model_path":"Qwen/Qwen2.5-0.5B-Instruct","served_model_name":"Qwen/Qwen2.5-0.5B-Instruct","pp_size":"1","dp_size":"1","version":"0.5.23","model_type":"qwen2","has_audio_understanding":"false","has_image_understanding":"false","context_length":"32768","max_running_requests":"256"},"priority":50,"cost":1.0,"max_connection_attempts":20,"is_healthy":true,"status":"ready","load":0,"http2":false}],"total":2,"stats":{"prefill_count":0,"decode_count":0,"regular_count":2}}"""

# `GET /v1/rl/workers` (`--enable-rl`) for the worker of WORKERS_READY.
RL_WORKERS_READY = r"""{"protocol_version":1,"workers":[{"id":"01a23dcb-7560-74e5-b1a4-935be8293531","url":"http://127.0.0.1:18001","base_url":"http://127.0.0.1:18001","engine":"sglang","engine_version":"0.5.23","model_id":"Qwen/Qwen2.5-0.5B-Instruct","worker_type":"regular","connection_mode":"http","control_url":"http://127.0.0.1:18001","tp_size":1,"dp_size":1,"pp_size":1,"dp_ranks":1,"role":null,"health":"ready","weight_version":null,"labels":{"max_running_requests":"256","context_length":"32768","tokenizer_path":"Qwen/Qwen2.5-0.5B-Instruct","dp_size":"1","model_path":"Qwen/Qwen2.5-0.5B-Instruct","is_generation":"true","version":"0.5.23","has_audio_understanding":"false","architectures":"[\"Qwen2ForCausalLM\"]","has_image_understanding":"false","max_model_len":"32768","pp_size":"1","tp_size":"1","served_model_name":"Qwen/Qwen2.5-0.5B-Instruct","model_type":"qwen2"},"capabilities":{"source":"static","pause_modes":["abort","retract","in_place"],"update_from":["disk","tensor","distributed"],"abort":true,"flush_cache":true,"sleep_wake":true,"reports_weight_version":true}}],"total":1}"""

# `GET /v1/rl/workers` at the moment of WORKERS_NOT_READY (json.dump re-serialised).
RL_WORKERS_NOT_READY = r"""{"protocol_version": 1, "workers": [{"id": "01a23dcc-5a8e-7592-96cf-d7c8da40e086", "url": "http://127.0.0.1:18002", "base_url": "http://127.0.0.1:18002", "engine": "sglang", "engine_version": "0.5.23", "model_id": "Qwen/Qwen2.5-0.5B-Instruct", "worker_type": "regular", "connection_mode": "http", "control_url": "http://127.0.0.1:18002", "tp_size": 1, "dp_size": 1, "pp_size": 1, "dp_ranks": 1, "role": null, "health": "not_ready", "weight_version": null, "labels": {"max_running_requests": "256", "has_audio_understanding": "false", "model_type": "qwen2", "model_path": "Qwen/Qwen2.5-0.5B-Instruct", "max_model_len": "32768", "pp_size": "1", "is_generation": "true", "served_model_name": "Qwen/Qwen2.5-0.5B-Instruct", "version": "0.5.23", "tokenizer_path": "Qwen/Qwen2.5-0.5B-Instruct", "tp_size": "1", "context_length": "32768", "dp_size": "1", "has_image_understanding": "false", "architectures": "[\"Qwen2ForCausalLM\"]"}, "capabilities": {"source": "static", "pause_modes": ["abort", "retract", "in_place"], "update_from": ["disk", "tensor", "distributed"], "abort": true, "flush_cache": true, "sleep_wake": true, "reports_weight_version": true}}], "total": 1}"""

# 202 to `POST /workers {"url": ..., "labels": {...}}`.
POST_ACCEPTED = r"""{"status":"accepted","worker_id":"01a23dce-dfcd-7507-9069-de1619a1fe41","url":"http://127.0.0.1:18001","location":"/workers/01a23dce-dfcd-7507-9069-de1619a1fe41","message":"Worker addition queued for background processing"}"""

# 409 to a second `POST /workers` with the same URL string.
POST_CONFLICT = r"""{"error":"Worker already exists at URL 'http://127.0.0.1:18001' with ID 01a23dcb-7560-74e5-b1a4-935be8293531. Use PUT /workers/01a23dcb-7560-74e5-b1a4-935be8293531 to replace or PATCH /workers/01a23dcb-7560-74e5-b1a4-935be8293531 to update.","code":"WORKER_ALREADY_EXISTS"}"""

# 409 to a second `POST /workers` for a URL whose first registration is still pending.
POST_IN_PROGRESS = r"""{"error":"Worker creation already in progress for URL 'http://127.0.0.1:18059' with ID 01a23dd4-f57b-7474-a013-7b4d5239253c. Poll GET /workers/01a23dd4-f57b-7474-a013-7b4d5239253c.","code":"WORKER_CREATE_IN_PROGRESS"}"""

# 400 to `POST /workers {"url": "127.0.0.1:18011"}` (no scheme).
POST_NO_SCHEME = r"""{"error":"Invalid value for field 'worker_url': 127.0.0.1:18011 - URL must start with a lowercase http://, https://, grpc://, grpcs://, or ipc:// scheme","code":"BAD_REQUEST"}"""

# 400 to `POST /workers {}`.
POST_NO_URL = r"""{"error":"Invalid JSON data: Failed to deserialize the JSON body into the target type: missing field `url` at line 1 column 2","code":"BAD_REQUEST"}"""

# 401 to `GET /workers` and `POST /workers` without the key, from `smg launch --api-key sekret`.
GATEWAY_NO_KEY = r"""{"error":{"message":"Missing API key: send it as `Authorization: Bearer <key>`","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"""

# `GET /workers` with nothing registered (or only registrations still pending).
WORKERS_EMPTY = (
    r"""{"workers":[],"total":0,"stats":{"prefill_count":0,"decode_count":0,"regular_count":0}}"""
)


Handler = Callable[[httpx.Request], httpx.Response]


def answering(status: int, body: str, seen: list[httpx.Request]) -> Handler:
    """A handler that records each request and answers `status` with `body` as smg does."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            status, content=body.encode(), headers={"content-type": "application/json"}
        )

    return handler


def run(handler: Handler, call: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await call(http)

    return asyncio.run(go())


def list_workers(body: str, status: int = 200, gateway: str = GATEWAY) -> Any:
    seen: list[httpx.Request] = []
    workers = run(answering(status, body, seen), lambda http: smg_workers(http, gateway))
    return workers, seen


# -- smg_workers ------------------------------------------------------------------------------


def test_ready_worker_is_parsed_from_get_workers() -> None:
    workers, seen = list_workers(WORKERS_READY)
    assert workers == [
        SmgWorker(
            url="http://127.0.0.1:18001",
            worker_id="01a23dcb-7560-74e5-b1a4-935be8293531",
            healthy=True,
        )
    ]
    assert [(r.method, str(r.url)) for r in seen] == [("GET", GATEWAY + "/workers")]


def test_gateway_url_with_a_trailing_slash() -> None:
    _, seen = list_workers(WORKERS_READY, gateway=GATEWAY + "/")
    assert str(seen[0].url) == GATEWAY + "/workers"


@pytest.mark.parametrize(
    ("body", "url"),
    [
        (WORKERS_NOT_READY, "http://127.0.0.1:18002"),
        (WORKERS_FAILED, "http://127.0.0.1:18021"),
        (WORKERS_DRAINING, "http://127.0.0.1:18001"),
    ],
    ids=["not_ready", "failed", "draining"],
)
def test_unhealthy_states_are_listed_as_unhealthy(body: str, url: str) -> None:
    workers, _ = list_workers(body)
    assert [(w.url, w.healthy) for w in workers] == [(url, False)]


def test_two_spellings_of_one_url_are_two_workers() -> None:
    workers, _ = list_workers(WORKERS_TWO_URL_SPELLINGS)
    assert workers == [
        SmgWorker("http://127.0.0.1:18011/", "01a23dd0-a48e-76f2-8131-7cfadcfd6cfc", True),
        SmgWorker("http://127.0.0.1:18011", "01a23dd0-a6a2-75c2-836c-431af083e1ef", True),
    ]


def test_empty_registry() -> None:
    workers, _ = list_workers(WORKERS_EMPTY)
    assert workers == []


def test_worker_is_frozen() -> None:
    (worker,), _ = list_workers(WORKERS_READY)
    with pytest.raises(AttributeError):
        worker.healthy = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("body", "healthy"), [(RL_WORKERS_READY, True), (RL_WORKERS_NOT_READY, False)]
)
def test_rl_worker_list_shape_is_understood(body: str, healthy: bool) -> None:
    (worker,) = parse_workers(json.loads(body))
    assert worker.worker_id.startswith("01a23dc")
    assert worker.url.startswith("http://127.0.0.1:")
    assert worker.healthy is healthy


def test_missing_optional_fields() -> None:
    ready = json.loads(WORKERS_READY)["workers"][0]
    no_flag = {k: v for k, v in ready.items() if k != "is_healthy"}
    not_ready = {**no_flag, "status": "not_ready"}
    bare = {"id": "w-1", "url": "http://e:1"}
    workers = parse_workers({"workers": [no_flag, not_ready, bare]})
    assert [w.healthy for w in workers] == [True, False, False]
    assert workers[2] == SmgWorker(url="http://e:1", worker_id="w-1", healthy=False)


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ([], "expected a JSON object with a 'workers' list"),
        ({"error": "nope", "code": "BAD_REQUEST"}, "expected a JSON object with a 'workers' list"),
        ({"workers": {}}, "expected a JSON object with a 'workers' list"),
        ({"workers": ["http://e:1"]}, "workers[0]: expected an object"),
        ({"workers": [{"id": "w-1"}]}, "workers[0]: no 'url' string"),
        ({"workers": [{"id": "w-1", "url": ""}]}, "workers[0]: no 'url' string"),
        (
            {"workers": [{"id": "w-1", "url": "http://e:1"}, {"url": "http://e:2"}]},
            "workers[1]: no 'id' string",
        ),
        ({"workers": [{"id": 7, "url": "http://e:1"}]}, "workers[0]: no 'id' string"),
    ],
)
def test_unexpected_shape_is_a_clear_error(payload: Any, needle: str) -> None:
    with pytest.raises(SmgError) as err:
        list_workers(json.dumps(payload))
    assert needle in str(err.value)
    assert "GET http://smg.test:30000/workers" in str(err.value)


def test_error_status_is_an_smg_error() -> None:
    with pytest.raises(SmgError, match="HTTP 503"):
        list_workers('{"error":"down"}', status=503)


def test_non_json_body_is_an_smg_error() -> None:
    with pytest.raises(SmgError, match="not JSON"):
        list_workers("<html>proxy error</html>")


# -- smg_register -----------------------------------------------------------------------------


def register(status: int, body: str, worker_url: str, **kw: Any) -> list[httpx.Request]:
    seen: list[httpx.Request] = []
    result = run(
        answering(status, body, seen),
        lambda http: smg_register(http, GATEWAY, worker_url, **kw),
    )
    assert result is None
    return seen


def test_register_posts_the_url() -> None:
    seen = register(202, POST_ACCEPTED, "http://127.0.0.1:18001")
    assert [(r.method, str(r.url)) for r in seen] == [("POST", GATEWAY + "/workers")]
    assert json.loads(seen[0].content) == {"url": "http://127.0.0.1:18001"}


def test_register_strips_a_trailing_slash_and_sends_labels() -> None:
    seen = register(202, POST_ACCEPTED, "http://127.0.0.1:18001/", labels={"april.role": "engine"})
    assert json.loads(seen[0].content) == {
        "url": "http://127.0.0.1:18001",
        "labels": {"april.role": "engine"},
    }


@pytest.mark.parametrize("body", [POST_CONFLICT, POST_IN_PROGRESS], ids=["listed", "pending"])
def test_register_twice_is_fine(body: str) -> None:
    seen = register(409, body, "http://127.0.0.1:18001")
    assert len(seen) == 1


@pytest.mark.parametrize("body", [POST_NO_SCHEME, POST_NO_URL])
def test_register_rejected(body: str) -> None:
    with pytest.raises(SmgError, match="HTTP 400") as err:
        register(400, body, "127.0.0.1:18011")
    assert "BAD_REQUEST" in str(err.value)


def test_other_conflict_is_an_error() -> None:
    with pytest.raises(SmgError, match="HTTP 409"):
        register(409, '{"error":"busy","code":"SOMETHING_ELSE"}', "http://127.0.0.1:18001")


def test_register_sends_the_worker_key() -> None:
    seen = register(202, POST_ACCEPTED, "http://127.0.0.1:18054", api_key="wkey")
    assert json.loads(seen[0].content) == {"url": "http://127.0.0.1:18054", "api_key": "wkey"}


def test_gateway_key_missing() -> None:
    with pytest.raises(SmgError, match="HTTP 401"):
        list_workers(GATEWAY_NO_KEY, status=401)
    with pytest.raises(SmgError, match="invalid_api_key"):
        register(401, GATEWAY_NO_KEY, "http://127.0.0.1:18054")
