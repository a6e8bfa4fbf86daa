"""Typed clients for april-server: `AprilClient` (sync) and `AsyncAprilClient` (async).

Each public method builds a `Call` (`clients/_routes.py`: path, body, parser, idempotency)
and sends it; the two clients differ only in how they send. Needs only httpx and msgspec.
Errors: see `clients/_errors.py` (a tree of `AprilError`).

    with AprilClient("http://127.0.0.1:30000") as c:
        resp = c.rollout(groups, target_groups=4, request_id="step-1")
        for g in resp.groups: ...
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

import httpx

from april_server.protocol import (
    AbortResp,
    DeleteResp,
    DoneEvent,
    Group,
    GroupFinishedEvent,
    GroupSpec,
    KvMode,
    OnQuota,
    ResumeResp,
    RolloutResp,
)
from clients import _routes as routes
from clients._errors import AprilError, TransportError

T = TypeVar("T")
Event = GroupFinishedEvent | DoneEvent
# Generations can take minutes: a long read timeout, short connect/write/pool ones.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=1800.0, write=60.0, pool=60.0)
GroupArg = Sequence[GroupSpec | Mapping[str, Any]]


def _rollout_call(
    groups: GroupArg,
    target_groups: int,
    resume_first: bool,
    on_quota: OnQuota,
    max_staleness: int | None,
    max_inflight_groups: int | Literal["auto"],
    request_id: str | None,
    stream: bool,
) -> routes.Call[RolloutResp]:
    return routes.rollout(
        groups,
        target_groups,
        resume_first=resume_first,
        on_quota=on_quota,
        max_staleness=max_staleness,
        max_inflight_groups=max_inflight_groups,
        request_id=request_id,
        stream=stream,
    )


class _Base:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        timeout: httpx.Timeout | float,
        retries: int,
        retry_backoff_s: float,
        headers: Mapping[str, str] | None,
    ) -> None:
        self.base_url = routes.check_base_url(base_url)
        self.retry = routes.RetryPolicy(retries, retry_backoff_s)
        self._headers = routes.client_headers(api_key, headers)
        self._timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)

    def _url(self, call: routes.Call[Any]) -> str:
        return self.base_url + call.path


class AprilClient(_Base):
    """Synchronous client; owns one `httpx.Client` (use it as a context manager)."""

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
        super().__init__(
            base_url,
            api_key=api_key,
            timeout=timeout,
            retries=retries,
            retry_backoff_s=retry_backoff_s,
            headers=headers,
        )
        self._http = httpx.Client(headers=self._headers, timeout=self._timeout, transport=transport)

    def __enter__(self) -> AprilClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: routes.Call[T]) -> T:
        attempt = 0
        while True:
            url = self._url(call)
            try:
                try:
                    r = self._http.request(
                        call.method, url, content=call.body, headers=call.headers
                    )
                except httpx.RequestError as exc:
                    raise TransportError(exc, method=call.method, url=url) from exc
                return routes.finish(call, url, r.status_code, r.content)
            except AprilError as exc:
                delay = self.retry.next_delay(call, exc, attempt)
                if delay is None:
                    raise
                time.sleep(delay)
                attempt += 1

    # ---- april routes --------------------------------------------------------------------

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
    ) -> RolloutResp:
        return self._send(
            _rollout_call(
                groups,
                target_groups,
                resume_first,
                on_quota,
                max_staleness,
                max_inflight_groups,
                request_id,
                False,
            )  # fmt: skip
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
    ) -> Iterator[Event]:
        """NDJSON events: `group_finished` as groups finish, then `done`."""
        call = _rollout_call(
            groups, target_groups, resume_first, on_quota, max_staleness,
            max_inflight_groups, request_id, True,
        )  # fmt: skip
        url = self._url(call)
        reader = routes.EventReader(url)
        try:
            with self._http.stream(call.method, url, content=call.body, headers=call.headers) as r:
                if not 200 <= r.status_code < 300:
                    r.read()
                    routes.check_status(call, url, r.status_code, r.content)
                for chunk in r.iter_bytes():
                    yield from reader.feed(chunk)
        except httpx.RequestError as exc:
            raise TransportError(exc, method=call.method, url=url) from exc
        yield from reader.end()

    def reject(self, batch_id: str, group_ids: Sequence[str]) -> dict[str, Any]:
        return self._send(routes.reject(batch_id, group_ids))

    def abort(
        self,
        *,
        batch_id: str | None = None,
        group_ids: Sequence[str] | None = None,
        sample_ids: Sequence[str] | None = None,
        all: bool = False,  # noqa: A002 - the contract's field name
        keep: OnQuota = "tokens",
    ) -> AbortResp:
        return self._send(routes.abort(batch_id, group_ids, sample_ids, all, keep))

    def resume(
        self,
        sample_ids: Sequence[str],
        *,
        append_ids: Mapping[str, Sequence[int]] | None = None,
        kv: KvMode = "auto",
        sampling_params: Mapping[str, Any] | None = None,
    ) -> ResumeResp:
        return self._send(routes.resume(sample_ids, append_ids, kv, sampling_params))

    def partials(self) -> list[Group]:
        return self._send(routes.partials())

    def partial(self, group_id: str) -> Group:
        return self._send(routes.partial(group_id))

    def delete_partial(self, group_id: str) -> DeleteResp:
        return self._send(routes.delete_partial(group_id))

    def stats(self) -> dict[str, Any]:
        return self._send(routes.stats())

    # ---- SGLang native routes a trainer needs --------------------------------------------

    def metrics(self) -> str:
        return self._send(routes.metrics())

    def health(self) -> bool:
        try:
            self._send(routes.health())
        except AprilError:
            return False
        return True

    def flush_cache(self) -> None:
        self._send(routes.flush_cache())

    def generate(
        self,
        input_ids: Sequence[int] | None,
        sampling_params: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Any:
        return self._send(routes.generate(input_ids, sampling_params, extra))

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        return self._send(routes.update_weights_from_disk(model_path, weight_version, extra))


class AsyncAprilClient(_Base):
    """Asynchronous client; owns one `httpx.AsyncClient` (use `async with`)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retries: int = 0,
        retry_backoff_s: float = 0.5,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            api_key=api_key,
            timeout=timeout,
            retries=retries,
            retry_backoff_s=retry_backoff_s,
            headers=headers,
        )
        self._http = httpx.AsyncClient(
            headers=self._headers, timeout=self._timeout, transport=transport
        )

    async def __aenter__(self) -> AsyncAprilClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: routes.Call[T]) -> T:
        attempt = 0
        while True:
            url = self._url(call)
            try:
                try:
                    r = await self._http.request(
                        call.method, url, content=call.body, headers=call.headers
                    )
                except httpx.RequestError as exc:
                    raise TransportError(exc, method=call.method, url=url) from exc
                return routes.finish(call, url, r.status_code, r.content)
            except AprilError as exc:
                delay = self.retry.next_delay(call, exc, attempt)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                attempt += 1

    async def rollout(
        self,
        groups: GroupArg,
        target_groups: int,
        *,
        resume_first: bool = True,
        on_quota: OnQuota = "snapshot",
        max_staleness: int | None = None,
        max_inflight_groups: int | Literal["auto"] = "auto",
        request_id: str | None = None,
    ) -> RolloutResp:
        return await self._send(
            _rollout_call(
                groups,
                target_groups,
                resume_first,
                on_quota,
                max_staleness,
                max_inflight_groups,
                request_id,
                False,
            )  # fmt: skip
        )

    async def rollout_stream(
        self,
        groups: GroupArg,
        target_groups: int,
        *,
        resume_first: bool = True,
        on_quota: OnQuota = "snapshot",
        max_staleness: int | None = None,
        max_inflight_groups: int | Literal["auto"] = "auto",
        request_id: str | None = None,
    ) -> AsyncIterator[Event]:
        call = _rollout_call(
            groups, target_groups, resume_first, on_quota, max_staleness,
            max_inflight_groups, request_id, True,
        )  # fmt: skip
        url = self._url(call)
        reader = routes.EventReader(url)
        try:
            async with self._http.stream(
                call.method, url, content=call.body, headers=call.headers
            ) as r:
                if not 200 <= r.status_code < 300:
                    await r.aread()
                    routes.check_status(call, url, r.status_code, r.content)
                async for chunk in r.aiter_bytes():
                    for ev in reader.feed(chunk):
                        yield ev
        except httpx.RequestError as exc:
            raise TransportError(exc, method=call.method, url=url) from exc
        for ev in reader.end():
            yield ev

    async def reject(self, batch_id: str, group_ids: Sequence[str]) -> dict[str, Any]:
        return await self._send(routes.reject(batch_id, group_ids))

    async def abort(
        self,
        *,
        batch_id: str | None = None,
        group_ids: Sequence[str] | None = None,
        sample_ids: Sequence[str] | None = None,
        all: bool = False,  # noqa: A002 - the contract's field name
        keep: OnQuota = "tokens",
    ) -> AbortResp:
        return await self._send(routes.abort(batch_id, group_ids, sample_ids, all, keep))

    async def resume(
        self,
        sample_ids: Sequence[str],
        *,
        append_ids: Mapping[str, Sequence[int]] | None = None,
        kv: KvMode = "auto",
        sampling_params: Mapping[str, Any] | None = None,
    ) -> ResumeResp:
        return await self._send(routes.resume(sample_ids, append_ids, kv, sampling_params))

    async def partials(self) -> list[Group]:
        return await self._send(routes.partials())

    async def partial(self, group_id: str) -> Group:
        return await self._send(routes.partial(group_id))

    async def delete_partial(self, group_id: str) -> DeleteResp:
        return await self._send(routes.delete_partial(group_id))

    async def stats(self) -> dict[str, Any]:
        return await self._send(routes.stats())

    async def metrics(self) -> str:
        return await self._send(routes.metrics())

    async def health(self) -> bool:
        try:
            await self._send(routes.health())
        except AprilError:
            return False
        return True

    async def flush_cache(self) -> None:
        await self._send(routes.flush_cache())

    async def generate(
        self,
        input_ids: Sequence[int] | None,
        sampling_params: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Any:
        return await self._send(routes.generate(input_ids, sampling_params, extra))

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        return await self._send(routes.update_weights_from_disk(model_path, weight_version, extra))
