"""Streamed rollouts (NDJSON, `_stream.py`) on both clients: decoding split anywhere, early close,
errors before the first event and broken streams, retries of the opening request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from april_client import AprilClient, AsyncAprilClient, InvalidRequest, ProtocolError, ServerError
from april_client.protocol import DoneEvent, GroupFinishedEvent
from tests.unit.client.client_fakes import (
    DONE_LINE,
    FINISHED_LINE,
    SPEC,
    URL,
    Handler,
    recorder,
    unavailable,
)


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
            "groups": [SPEC],
            "target_groups": 2,
            "stream": True,
            "request_id": "r",
        }


def test_stream_closed_early_closes_the_response() -> None:
    streams: list[Chunks] = []

    def handler(req: httpx.Request) -> httpx.Response:
        streams.append(Chunks([FINISHED_LINE, FINISHED_LINE, FINISHED_LINE, DONE_LINE]))
        return httpx.Response(200, stream=streams[-1])

    with AprilClient(URL, transport=httpx.MockTransport(handler)) as c:
        with c.rollout_stream([SPEC], 3) as s:
            assert isinstance(next(s), GroupFinishedEvent)
        assert streams[0].closed and streams[0].sent == 1
        # Known from the first event, before any done (review of 2026-12-06: it was None
        # until done, so a trainer could not reject while the stream ran).
        assert list(s) == [] and s.batch_id == "b"

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
    [
        (FINISHED_LINE, "before its done"),
        (FINISHED_LINE + b"{oops}\n", "bad event line"),
        (b'{"event": "started"}\n', "bad event line"),
        (DONE_LINE + FINISHED_LINE, "after its done"),
    ],
)
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
    with AprilClient(
        URL, transport=httpx.MockTransport(handler_for(sync_calls)), retries=1, retry_backoff_s=0
    ) as c:
        assert len(list(c.rollout_stream([SPEC], 1, request_id="r"))) == 2
        with pytest.raises(ServerError):
            sync_calls.clear()
            list(c.rollout_stream([SPEC], 1))  # no request_id: not retried
    async_calls: list[int] = []

    async def go() -> int:
        async with AsyncAprilClient(
            URL,
            transport=httpx.MockTransport(handler_for(async_calls)),
            retries=1,
            retry_backoff_s=0,
        ) as ac:
            return len([e async for e in ac.rollout_stream([SPEC], 1, request_id="r")])

    assert asyncio.run(go()) == 2 and len(async_calls) == 2
