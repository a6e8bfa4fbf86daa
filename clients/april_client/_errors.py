"""Exceptions raised by the april-server client.

    AprilError                  base: catch this to catch everything below
    ├── RequestRejected         4xx: the server refused the request (status_code, code, message)
    │   ├── InvalidRequest      400, 422: malformed JSON or a body that breaks the schema
    │   ├── Unauthorized        401, 403: missing or wrong API key
    │   ├── NotFound            404: unknown group, sample or batch
    │   └── Conflict            409: e.g. resuming a sample that is already running
    ├── ServerError             5xx: a server bug, or a proxy in front of it (status_code, ...)
    ├── ProtocolError           a success whose body is not the contract's shape
    └── TransportError          connect/read/write failure or timeout (wraps httpx.RequestError)

`code` and `message` come from the contract's error body `{"error": {"code", "message"}}`.
Bodies of other shapes (SGLang's native routes, a proxy's HTML page) still map by status:
`code` is then `http_<status>` and `message` the body's `message`/`detail` or its text.
Invalid arguments caught before any request is sent raise a plain `ValueError`.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

MAX_MESSAGE_CHARS = 2000  # a proxy's HTML error page is not worth more in a traceback


class AprilError(Exception):
    """Base of every error the client raises (except `ValueError` for bad arguments)."""


class _StatusError(AprilError):
    """An error response: `status_code`, `code` and `message`, plus the request it answered."""

    def __init__(
        self, status_code: int, code: str, message: str, *, method: str = "", url: str = ""
    ) -> None:
        super().__init__(f"{status_code} {code}: {message}{_where(method, url)}")
        self.status_code = status_code
        self.code = code
        self.message = message
        self.method = method
        self.url = url


class RequestRejected(_StatusError):
    """4xx: the request was refused; retrying it unchanged will not help."""


class InvalidRequest(RequestRejected):
    """400 or 422: malformed JSON, wrong types, unknown fields or inconsistent values."""


class Unauthorized(RequestRejected):
    """401 or 403: the server wants a (different) API key."""


class NotFound(RequestRejected):
    """404: no such group, sample, batch or route."""


class Conflict(RequestRejected):
    """409: the request clashes with the server's state (e.g. the sample is running)."""


class ServerError(_StatusError):
    """5xx: the server (or a proxy in front of it) failed; a 5xx from april-server is a bug."""


class ProtocolError(AprilError):
    """A response the client cannot read: undecodable body, unexpected shape, cut stream."""


class TransportError(AprilError):
    """The request did not complete: connection refused or reset, timeout, broken stream.

    The httpx exception is `cause` (and `__cause__`).
    """

    def __init__(self, cause: httpx.RequestError, *, method: str = "", url: str = "") -> None:
        super().__init__(f"{type(cause).__name__}: {cause}{_where(method, url)}")
        self.cause = cause
        self.method = method
        self.url = url


def _where(method: str, url: str) -> str:
    return f" [{method} {url}]" if method or url else ""


_BY_STATUS: dict[int, type[RequestRejected]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    422: InvalidRequest,
}


class _ContractError(msgspec.Struct):
    code: str
    message: str


class _ContractErrorBody(msgspec.Struct):
    error: _ContractError


_contract_decoder = msgspec.json.Decoder(_ContractErrorBody)


def error_from_response(
    status_code: int, content: bytes, *, method: str = "", url: str = ""
) -> AprilError:
    """The exception for a non-2xx answer. Never raises; any body shape is accepted."""
    code, message = _code_and_message(status_code, content)
    if 400 <= status_code < 500:
        cls = _BY_STATUS.get(status_code, RequestRejected)
        return cls(status_code, code, message, method=method, url=url)
    if status_code >= 500:
        return ServerError(status_code, code, message, method=method, url=url)
    # 1xx/3xx: the client does not follow redirects, so one means a wrong base_url.
    return ProtocolError(f"unexpected HTTP {status_code}: {message}{_where(method, url)}")


def _code_and_message(status_code: int, content: bytes) -> tuple[str, str]:
    fallback_code = f"http_{status_code}"
    try:
        body = _contract_decoder.decode(content)
        return body.error.code, body.error.message
    except msgspec.DecodeError:  # not the contract's shape: try the common others
        pass
    try:
        obj: Any = msgspec.json.decode(content)
    except msgspec.DecodeError:
        obj = None
    if isinstance(obj, dict):
        inner = obj.get("error")
        if isinstance(inner, dict):  # {"error": {"message": ...}} without a code
            obj = inner
        for key in ("message", "detail"):  # SGLang native routes; FastAPI validation
            if key in obj:
                value = obj[key]
                text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
                return fallback_code, _clip(text)
    text = content.decode("utf-8", errors="replace").strip()
    return fallback_code, _clip(text) or httpx.codes.get_reason_phrase(status_code)


def _clip(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[:MAX_MESSAGE_CHARS] + f"... ({len(text)} chars)"
