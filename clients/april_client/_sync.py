"""`AprilClient`: the blocking client over one `httpx.Client` (its asyncio twin is `_async.py`).

Each route method is one line over `_routes.py`; `_send` is the one generic send, with opt-in
retries of idempotent calls; streamed rollouts are `RolloutStream`s (`_stream.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

import httpx

from . import _routes as routes
from . import _weight_routes as weights
from ._base import DEFAULT_TIMEOUT, LIMITS, UNHEALTHY, GroupArg, _ClientBase
from ._errors import AprilError
from ._routes import Call
from ._stream import RolloutStream
from .protocol import (
    AbortResp,
    DeleteResp,
    Group,
    GroupsResp,
    InputResp,
    Keep,
    KvMode,
    OnQuota,
    PartialsResp,
    ResumeResp,
    RolloutResp,
    WeightGroupInfo,
)

T = TypeVar("T")
R = TypeVar("R")


class AprilClient(_ClientBase):
    """Blocking client over one `httpx.Client`.

    `retries` (default 0) retries idempotent calls only (GETs, `abort`, `rollout` with a
    `request_id`) after a transport error or a 5xx, waiting `retry_backoff_s * 2**k`.
    `transport` replaces the network, e.g. with `httpx.MockTransport` in tests.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retries: int = 0,
        retry_backoff_s: float = 0.5,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, api_key, headers, retries, retry_backoff_s)
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=self._headers,
            timeout=self._timeout(timeout),
            limits=LIMITS,
            transport=transport,
        )

    # ---- sending -----------------------------------------------------------------------------

    def _retrying(self, call: Call[Any], attempt: Callable[[], R]) -> R:
        n = 0
        while True:
            try:
                return attempt()
            except AprilError as exc:
                delay = self.retry.next_delay(call, exc, n)
                if delay is None:
                    raise
            time.sleep(delay)
            n += 1

    def _send_once(self, call: Call[T]) -> T:
        try:
            r = self._http.request(call.method, call.path, content=call.body, headers=call.headers)
        except httpx.RequestError as exc:
            raise self._transport_error(call, exc) from exc
        return routes.finish(call, self._url(call), r.status_code, r.content)

    def _send(self, call: Call[T]) -> T:
        return self._retrying(call, lambda: self._send_once(call))

    def _open_stream_once(self, call: Call[Any]) -> httpx.Response:
        request = self._http.build_request(
            call.method, call.path, content=call.body, headers=call.headers
        )
        try:
            response = self._http.send(request, stream=True)
            if not response.is_success:
                try:
                    content = response.read()
                finally:
                    response.close()
                routes.check_status(call, self._url(call), response.status_code, content)
        except httpx.RequestError as exc:
            raise self._transport_error(call, exc) from exc
        return response

    def _open_stream(self, call: Call[Any]) -> httpx.Response:
        return self._retrying(call, lambda: self._open_stream_once(call))

    # ---- april routes ------------------------------------------------------------------------

    def rollout(
        self,
        groups: GroupArg,
        target_groups: int,
        *,
        resume_first: bool = True,
        on_quota: OnQuota = "snapshot",
        max_staleness: int | None = None,
        max_inflight_groups: int | Literal["auto"] = "auto",
        request_id: str | None = None,
        turns: routes.TurnsArg = None,
        return_routed_experts: bool = False,
        return_sampling_mask: bool = False,
    ) -> RolloutResp:
        """POST /rollouts: run until `target_groups` groups finish; the rest is buffered.
        `return_routed_experts`: every new group's samples carry their routing (MoE);
        `return_sampling_mask`: their sampling masks (top-k / top-p kept sets)."""
        return self._send(
            routes.rollout(
                groups,
                target_groups,
                resume_first=resume_first,
                on_quota=on_quota,
                max_staleness=max_staleness,
                max_inflight_groups=max_inflight_groups,
                request_id=request_id,
                stream=False,
                turns=turns,
                return_routed_experts=return_routed_experts,
                return_sampling_mask=return_sampling_mask,
            )
        )

    def rollout_stream(
        self,
        groups: GroupArg,
        target_groups: int,
        *,
        resume_first: bool = True,
        on_quota: OnQuota = "snapshot",
        max_staleness: int | None = None,
        max_inflight_groups: int | Literal["auto"] = "auto",
        request_id: str | None = None,
        turns: routes.TurnsArg = None,
        return_sampling_mask: bool = False,
    ) -> RolloutStream:
        """POST /rollouts with `stream: true`: iterate the events as groups finish."""
        call = routes.rollout(
            groups,
            target_groups,
            resume_first=resume_first,
            on_quota=on_quota,
            max_staleness=max_staleness,
            max_inflight_groups=max_inflight_groups,
            request_id=request_id,
            stream=True,
            turns=turns,
            return_sampling_mask=return_sampling_mask,
        )
        return RolloutStream(call, self._url(call), lambda: self._open_stream(call))

    def add_groups(
        self,
        groups: GroupArg,
        *,
        start: Literal["background", "idle"] = "background",
        max_staleness: int | None = None,
        request_id: str | None = None,
        turns: routes.TurnsArg = None,
        return_sampling_mask: bool = False,
    ) -> GroupsResp:
        """POST /groups: hand groups in without waiting (prefetch); `background` generates
        them between calls, `idle` only buffers them. A later call serves them."""
        return self._send(
            routes.add_groups(
                groups,
                start=start,
                max_staleness=max_staleness,
                request_id=request_id,
                turns=turns,
                return_sampling_mask=return_sampling_mask,
            )
        )

    def reject(self, batch_id: str, group_ids: Sequence[str]) -> dict[str, Any]:
        """Un-count finished groups of a running streamed rollout (DAPO-style filtering)."""
        return self._send(routes.reject(batch_id, group_ids))

    def abort(
        self,
        batch_id: str | None = None,
        *,
        group_ids: Sequence[str] | None = None,
        sample_ids: Sequence[str] | None = None,
        all: bool = False,
        keep: Keep = "tokens",
    ) -> AbortResp:
        """Stop generation in scope; returns once nothing in scope is generating."""
        return self._send(routes.abort(batch_id, group_ids, sample_ids, all, keep))

    def resume(
        self,
        sample_ids: Sequence[str],
        append_ids: Mapping[str, Sequence[int]] | None = None,
        kv: KvMode = "auto",
        sampling_params: Mapping[str, Any] | None = None,
        return_sampling_mask: bool | None = None,
    ) -> ResumeResp:
        """Continue buffered samples; returns once they finish.
        `return_sampling_mask`: turn their sampling masks on or off (None: as they are)."""
        return self._send(
            routes.resume(sample_ids, append_ids, kv, sampling_params, return_sampling_mask)
        )

    def post_input(
        self,
        sample_id: str,
        append_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        turn: int | None = None,
    ) -> InputResp:
        """POST /samples/{sample_id}/input: the tool's answer for a member awaiting input
        (token ids, or text the server tokenizes). During its call the member continues at
        once (`batch_id` names the call); after it, the answer is kept and the member waits
        for the next call. `Conflict` (409 `not_awaiting`) when it is not awaiting input, or
        (with `turn`, the event's) not for that turn: a late retry never answers a later one."""
        return self._send(routes.post_input(sample_id, append_ids, text, turn))

    def partials_page(
        self,
        limit: int | None = None,
        cursor: str | None = None,
        *,
        status: Literal["partial", "finished"] | None = None,
        min_age_s: float | None = None,
        weight_version: str | None = None,
    ) -> PartialsResp:
        """One page of the idle buffer (oldest first); pass its `next_cursor` for the next."""
        return self._send(routes.partials_page(limit, cursor, status, min_age_s, weight_version))

    def partials(
        self,
        *,
        status: Literal["partial", "finished"] | None = None,
        min_age_s: float | None = None,
        weight_version: str | None = None,
    ) -> list[Group]:
        """Every idle buffered group, oldest first, page after page (a big buffer is big:
        prefer `partials_page`)."""
        groups: list[Group] = []
        cursor: str | None = None
        while True:
            page = self.partials_page(
                None, cursor, status=status, min_age_s=min_age_s, weight_version=weight_version
            )
            groups += page.groups
            if page.next_cursor is None:
                return groups
            cursor = page.next_cursor

    def partial(self, group_id: str) -> Group:
        return self._send(routes.partial(group_id))

    def delete_partial(self, group_id: str) -> DeleteResp:
        return self._send(routes.delete_partial(group_id))

    def stats(self) -> dict[str, Any]:
        return self._send(routes.stats())

    # ---- SGLang native routes ----------------------------------------------------------------

    def metrics(self) -> str:
        """Prometheus text exposition."""
        return self._send(routes.metrics())

    def health(self) -> bool:
        """True when /health answers 2xx; False on a 5xx or no connection (starting, down)."""
        try:
            self._send(routes.health())
        except UNHEALTHY:
            return False
        return True

    def generate(
        self,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None,
        sampling_params: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Any:
        """POST /generate (SGLang's answer: a dict, or a list of dicts for a batch)."""
        return self._send(routes.generate(input_ids, sampling_params, extra))

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        return self._send(weights.update_weights_from_disk(model_path, weight_version, extra))

    # ---- weights over the wire (`april_client.weight_sync` drives these) ---------------------

    def weight_group(self) -> WeightGroupInfo:
        """GET /april/v1/weights/group: the ranks a weight-update group needs, and its state."""
        return self._send(weights.weight_group())

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        rank_offset: int = 1,
    ) -> dict[str, Any]:
        """Returns once every rank joined: the trainer joins at the same time (rank 0)."""
        call = weights.init_weights_update_group(
            master_address, master_port, world_size, group_name, backend, rank_offset
        )
        return self._send(call)

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        return self._send(weights.destroy_weights_update_group(group_name))

    def begin_weight_update(self) -> dict[str, Any]:
        return self._send(weights.weight_session("begin"))

    def end_weight_update(self) -> dict[str, Any]:
        return self._send(weights.weight_session("end"))

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Returns once the trainer's broadcast of these tensors (in this order) arrived."""
        call = weights.update_weights_from_distributed(
            names, dtypes, shapes, group_name, weight_version, extra
        )
        return self._send(call)

    def flush_cache(self) -> None:
        """POST /flush_cache; SGLang answers 400 (`InvalidRequest`) while requests run."""
        self._send(routes.flush_cache())

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AprilClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
