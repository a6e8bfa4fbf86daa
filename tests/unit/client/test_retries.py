"""Opt-in retries (`_routes.py`'s `RetryPolicy`): only idempotent calls, after a transport error or
a 5xx, bounded, logged, with capped exponential backoff; on both clients."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from april_client import NotFound, ServerError, TransportError
from april_client._routes import Call, RetryPolicy
from tests.unit.client.client_fakes import (
    GROUP,
    ROLLOUT,
    RUNNERS,
    SPEC,
    Handler,
    answer,
    refuse,
    unavailable,
)


def flaky(failures: int, fail: Callable[[httpx.Request], httpx.Response], ok: Any) -> Any:
    """A handler that fails `failures` times (per client) then answers `ok`; counts calls."""
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.url.path)
        if len(calls) <= failures:
            return fail(req)
        return answer(body=ok)

    return calls, handler


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
    caplog.set_level(logging.WARNING, logger="april_client")
    with pytest.raises(ServerError) as e:
        run(
            handler,
            lambda c: c.rollout([SPEC], 1, request_id="step-9"),
            retries=2,
            retry_backoff_s=0,
        )
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
