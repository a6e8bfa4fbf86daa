"""What both clients share: the default timeout, the argument types, and the base class that
checks the URL, builds the headers and holds the retry policy (`_sync.py`, `_async.py`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from . import _routes as routes
from ._errors import ServerError, TransportError
from ._routes import Call, RetryPolicy
from .protocol import GroupSpec

# NOTE: read is the longest wait for the next bytes of an answer: a whole non-streamed rollout,
# or one group of a streamed one. A rollout of long generations takes minutes; an hour is an
# upper bound that still ends a hung call.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=3600.0, write=60.0, pool=60.0)
# The server (SGLang's uvicorn) closes a connection idle for SGLANG_TIMEOUT_KEEP_ALIVE, 5 s by
# default, and httpx keeps one for 5 s too: a request sent down a connection the server is
# closing at that moment fails with a ReadError (seen in `make chaos`). Ours expire first.
LIMITS = httpx.Limits(keepalive_expiry=2.0)

GroupArg = Sequence[GroupSpec | Mapping[str, Any]]
UNHEALTHY = (ServerError, TransportError)  # starting (503) or not listening: not an error


class _ClientBase:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        headers: Mapping[str, str] | None,
        retries: int,
        retry_backoff_s: float,
    ) -> None:
        self.base_url = routes.check_base_url(base_url)
        self._headers = routes.client_headers(api_key, headers)
        self.retry = RetryPolicy(retries, retry_backoff_s)

    @staticmethod
    def _timeout(timeout: httpx.Timeout | float) -> httpx.Timeout:
        # A bare number would cap connect and read alike; prefer an httpx.Timeout.
        return timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)

    def _url(self, call: Call[Any]) -> str:
        return self.base_url + call.path

    def _transport_error(self, call: Call[Any], exc: httpx.RequestError) -> TransportError:
        return TransportError(exc, method=call.method, url=self._url(call))
