"""What each route sends and how its answer is read, shared by the sync and async clients.

A route builder validates its arguments and returns a `Call`: method, path, JSON body, how to
parse a 2xx body, and whether the call is idempotent (only those are ever retried). The clients
only send calls, so each public method is one line in each client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote, urlencode

import msgspec

from ._errors import (
    AprilError,
    ProtocolError,
    ServerError,
    TransportError,
    error_from_response,
)
from .protocol import (
    AbortReq,
    AbortResp,
    DeleteResp,
    Group,
    GroupSpec,
    GroupsReq,
    GroupsResp,
    InputReq,
    InputResp,
    Keep,
    KvMode,
    OnQuota,
    PartialsResp,
    RejectReq,
    ResumeReq,
    ResumeResp,
    RolloutReq,
    RolloutResp,
    TurnsSpec,
)

logger = logging.getLogger("april_client")

PREFIX = "/april/v1"
MAX_RETRIES = 10
MAX_BACKOFF_S = 30.0
JSON_HEADERS = {"content-type": "application/json"}

T = TypeVar("T")
TurnsArg = TurnsSpec | Mapping[str, Any] | None

_encoder = msgspec.json.Encoder()
_any_decoder = msgspec.json.Decoder()
_dict_decoder = msgspec.json.Decoder(dict[str, Any])
_rollout_decoder = msgspec.json.Decoder(RolloutResp)
_abort_decoder = msgspec.json.Decoder(AbortResp)
_groups_decoder = msgspec.json.Decoder(GroupsResp)
_resume_decoder = msgspec.json.Decoder(ResumeResp)
_partials_decoder = msgspec.json.Decoder(PartialsResp)
_group_decoder = msgspec.json.Decoder(Group)
_delete_decoder = msgspec.json.Decoder(DeleteResp)
_input_decoder = msgspec.json.Decoder(InputResp)


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request: `parse` turns a 2xx body into the method's return value."""

    method: str
    path: str
    parse: Callable[[bytes], T]
    body: bytes | None = None
    idempotent: bool = False
    rid: str | None = None  # shown in retry logs; the rollout's request_id when set

    @property
    def headers(self) -> dict[str, str] | None:
        return JSON_HEADERS if self.body is not None else None


def check_status(call: Call[Any], url: str, status_code: int, content: bytes) -> None:
    """Raise the mapped `AprilError` for a non-2xx answer."""
    if not 200 <= status_code < 300:
        raise error_from_response(status_code, content, method=call.method, url=url)


def finish(call: Call[T], url: str, status_code: int, content: bytes) -> T:
    """The return value of a call from its answer, or the mapped error."""
    check_status(call, url, status_code, content)
    try:
        return call.parse(content)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"undecodable answer to {call.method} {url}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Opt-in, bounded retries of idempotent calls after a transport failure or a 5xx."""

    retries: int = 0
    backoff_s: float = 0.5  # before retry k (from 0): backoff_s * 2**k, at most MAX_BACKOFF_S

    def __post_init__(self) -> None:
        if not 0 <= self.retries <= MAX_RETRIES:
            raise ValueError(f"retries must be in [0, {MAX_RETRIES}], got {self.retries}")
        if self.backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.backoff_s}")

    def next_delay(self, call: Call[Any], exc: AprilError, attempt: int) -> float | None:
        """Seconds to wait before retrying after failed attempt `attempt` (from 0), or None
        to re-raise `exc`. Logs each retry at WARNING with its rid and cause."""
        retryable = isinstance(exc, TransportError | ServerError)
        if not (call.idempotent and retryable and attempt < self.retries):
            return None
        delay = min(self.backoff_s * 2.0**attempt, MAX_BACKOFF_S)
        logger.warning(
            "retry %d/%d of %s %s (rid=%s) in %.2fs after %s: %s",
            attempt + 1,
            self.retries,
            call.method,
            call.path,
            call.rid,
            delay,
            type(exc).__name__,
            exc,
        )
        return delay


def client_headers(api_key: str | None, headers: Mapping[str, str] | None) -> dict[str, str]:
    out = {"user-agent": "april-client/0.1", "accept": "application/json"}
    if api_key is not None:
        if not api_key:
            raise ValueError("api_key is empty; pass None to send no Authorization header")
        out["authorization"] = f"Bearer {api_key}"
    out.update(headers or {})
    return out


def check_base_url(base_url: str) -> str:
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    return base_url.rstrip("/")


# ---- bodies ----------------------------------------------------------------------------------


def _encode_req(req: msgspec.Struct) -> bytes:
    """The JSON body, checked against its own type so a bad argument fails here, not as a 422."""
    name = type(req).__name__
    try:
        data = _encoder.encode(req)
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"cannot encode {name} (token ids must be plain ints): {exc}") from None
    try:
        msgspec.json.decode(data, type=type(req))
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid {name}: {exc}") from None
    return data


def _encode_obj(obj: dict[str, Any]) -> bytes:
    try:
        return _encoder.encode(obj)
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"cannot encode the request body: {exc}") from None


def group_specs(groups: Sequence[GroupSpec | Mapping[str, Any]]) -> list[GroupSpec]:
    """`GroupSpec`s from structs or plain dicts; a bad dict raises `ValueError` naming it."""
    if isinstance(groups, GroupSpec | Mapping | str | bytes):
        raise ValueError(f"groups must be a list of group specs, not a {type(groups).__name__}")
    out: list[GroupSpec] = []
    for i, g in enumerate(groups):
        if isinstance(g, GroupSpec):
            out.append(g)
        elif isinstance(g, Mapping):
            try:
                out.append(msgspec.convert(dict(g), GroupSpec))
            except msgspec.ValidationError as exc:
                raise ValueError(f"groups[{i}] is not a valid group spec: {exc}") from None
        else:
            raise ValueError(f"groups[{i}] must be a GroupSpec or a dict, not {type(g).__name__}")
    return out


def turns_spec(turns: TurnsArg) -> TurnsSpec | None:
    """A call's `turns` from a struct or a dict (`{"stop": [...], "stop_token_ids": [...],
    "max_turns": k}`); a bad dict raises `ValueError`."""
    if turns is None or isinstance(turns, TurnsSpec):
        return turns
    try:
        return msgspec.convert(dict(turns), TurnsSpec)
    except msgspec.ValidationError as exc:
        raise ValueError(f"turns is not a valid turn rule: {exc}") from None


def _ids(name: str, ids: Sequence[str]) -> list[str]:
    # NOTE: list("g/0") would silently send ["g", "/", "0"].
    if isinstance(ids, str | bytes):
        raise ValueError(f"{name} must be a list of ids, not the string {ids!r}")
    return list(ids)


def _opt_ids(name: str, ids: Sequence[str] | None) -> list[str] | None:
    return None if ids is None else _ids(name, ids)


def _seg(value: str) -> str:
    return quote(value, safe="")


# ---- april routes ----------------------------------------------------------------------------


def rollout(
    groups: Sequence[GroupSpec | Mapping[str, Any]],
    target_groups: int,
    *,
    resume_first: bool,
    on_quota: OnQuota,
    max_staleness: int | None,
    max_inflight_groups: int | Literal["auto"],
    request_id: str | None,
    stream: bool,
    turns: TurnsArg = None,
    return_routed_experts: bool = False,
    return_sampling_mask: bool = False,
) -> Call[RolloutResp]:
    req = RolloutReq(
        groups=group_specs(groups),
        target_groups=target_groups,
        resume_first=resume_first,
        on_quota=on_quota,
        max_staleness=max_staleness,
        max_inflight_groups=max_inflight_groups,
        stream=stream,
        request_id=request_id,
        turns=turns_spec(turns),
        return_routed_experts=return_routed_experts,
        return_sampling_mask=return_sampling_mask,
    )
    # A request_id makes the call idempotent on the server, so only then may it be retried.
    return Call(
        "POST",
        f"{PREFIX}/rollouts",
        _rollout_decoder.decode,
        _encode_req(req),
        idempotent=request_id is not None,
        rid=request_id,
    )


def add_groups(
    groups: Sequence[GroupSpec | Mapping[str, Any]],
    *,
    start: Literal["background", "idle"],
    max_staleness: int | None,
    request_id: str | None,
    turns: TurnsArg = None,
    return_sampling_mask: bool = False,
) -> Call[GroupsResp]:
    req = GroupsReq(
        groups=group_specs(groups),
        start=start,
        max_staleness=max_staleness,
        request_id=request_id,
        turns=turns_spec(turns),
        return_sampling_mask=return_sampling_mask,
    )
    return Call(
        "POST",
        f"{PREFIX}/groups",
        _groups_decoder.decode,
        _encode_req(req),
        idempotent=request_id is not None,
        rid=request_id,
    )


def reject(batch_id: str, group_ids: Sequence[str]) -> Call[dict[str, Any]]:
    body = _encode_req(RejectReq(group_ids=_ids("group_ids", group_ids)))
    return Call("POST", f"{PREFIX}/rollouts/{_seg(batch_id)}/reject", _dict_decoder.decode, body)


def abort(
    batch_id: str | None,
    group_ids: Sequence[str] | None,
    sample_ids: Sequence[str] | None,
    all_: bool,
    keep: Keep,
) -> Call[AbortResp]:
    req = AbortReq(
        batch_id=batch_id,
        group_ids=_opt_ids("group_ids", group_ids),
        sample_ids=_opt_ids("sample_ids", sample_ids),
        all=all_,
        keep=keep,
    )
    return Call("POST", f"{PREFIX}/abort", _abort_decoder.decode, _encode_req(req), idempotent=True)


def resume(
    sample_ids: Sequence[str],
    append_ids: Mapping[str, Sequence[int]] | None,
    kv: KvMode,
    sampling_params: Mapping[str, Any] | None,
    return_sampling_mask: bool | None = None,
) -> Call[ResumeResp]:
    req = ResumeReq(
        sample_ids=_ids("sample_ids", sample_ids),
        append_ids=None if append_ids is None else {k: list(v) for k, v in append_ids.items()},
        kv=kv,
        sampling_params=None if sampling_params is None else dict(sampling_params),
        return_sampling_mask=return_sampling_mask,
    )
    return Call("POST", f"{PREFIX}/resume", _resume_decoder.decode, _encode_req(req))


def post_input(
    sample_id: str, append_ids: Sequence[int] | None, text: str | None, turn: int | None = None
) -> Call[InputResp]:
    if (append_ids is None) == (text is None):
        raise ValueError("give exactly one of append_ids, text")
    if isinstance(append_ids, str | bytes):
        raise ValueError("append_ids must be a list of token ids")
    ids = None if append_ids is None else list(append_ids)
    body = _encode_req(InputReq(append_ids=ids, text=text, turn=turn))
    # A sample id is "{group_id}/{index}": its "/" stays a path separator (the route takes it).
    path = f"{PREFIX}/samples/{quote(sample_id, safe='/')}/input"
    # Not retried: a second answer for the same turn is a 409, whatever the first did.
    return Call("POST", path, _input_decoder.decode, body)


def partials_page(
    limit: int | None = None,
    cursor: str | None = None,
    status: Literal["partial", "finished"] | None = None,
    min_age_s: float | None = None,
    weight_version: str | None = None,
) -> Call[PartialsResp]:
    """One page of the idle buffer, oldest first; `next_cursor` of the answer goes on."""
    query = {
        k: v
        for k, v in {
            "limit": limit,
            "cursor": cursor,
            "status": status,
            "min_age_s": min_age_s,
            "weight_version": weight_version,
        }.items()
        if v is not None
    }
    path = f"{PREFIX}/partials" + ("?" + urlencode(query) if query else "")
    return Call("GET", path, _partials_decoder.decode, idempotent=True)


def partial(group_id: str) -> Call[Group]:
    path = f"{PREFIX}/partials/{_seg(group_id)}"
    return Call("GET", path, _group_decoder.decode, idempotent=True)


def delete_partial(group_id: str) -> Call[DeleteResp]:
    # Not retried: a retry after a lost answer would see 404 for a delete that succeeded.
    return Call("DELETE", f"{PREFIX}/partials/{_seg(group_id)}", _delete_decoder.decode)


def stats() -> Call[dict[str, Any]]:
    return Call("GET", f"{PREFIX}/stats", _dict_decoder.decode, idempotent=True)


# ---- SGLang native routes --------------------------------------------------------------------


def _text(content: bytes) -> str:
    return content.decode("utf-8")


def _nothing(content: bytes) -> None:
    return None


def metrics() -> Call[str]:
    return Call("GET", "/metrics", _text, idempotent=True)


def health() -> Call[None]:
    return Call("GET", "/health", _nothing, idempotent=True)


def flush_cache() -> Call[None]:
    return Call("POST", "/flush_cache", _nothing)


def generate(
    input_ids: Sequence[int] | Sequence[Sequence[int]] | None,
    sampling_params: Mapping[str, Any] | None,
    extra: Mapping[str, Any],
) -> Call[Any]:
    if extra.get("stream"):
        raise ValueError("stream=True is not supported by generate(); use rollout_stream()")
    body: dict[str, Any] = {}
    if input_ids is not None:
        body["input_ids"] = input_ids
    body["sampling_params"] = dict(sampling_params or {})
    body.update(extra)
    return Call("POST", "/generate", _any_decoder.decode, _encode_obj(body))
