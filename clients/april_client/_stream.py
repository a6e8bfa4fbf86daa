"""A streamed rollout (NDJSON): the reader of its events, and iterators, one per client flavour.

The request goes out on the first `next()`; the reader (`EventReader`) turns bytes into
events. After the `done` event, or on `close()`, the HTTP response is closed; closing early is a
client disconnect to the server, which then stops the call and keeps its state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import msgspec

from ._errors import ProtocolError, TransportError
from ._routes import Call
from .protocol import (
    DoneEvent,
    Group,
    GroupFinishedEvent,
    SampleAwaitingEvent,
    SampleInterruptedEvent,
    StreamEvent,
)

Event = GroupFinishedEvent | SampleAwaitingEvent | SampleInterruptedEvent | DoneEvent
_event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(StreamEvent)


class EventReader:
    """Bytes of an NDJSON rollout stream in, events out; a line may span chunks.

    Records what it has seen: `groups` (finished so far, in order) and `done` (the last event).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.groups: list[Group] = []
        self.done: DoneEvent | None = None
        self.batch_id: str | None = None  # every event names its call: the first one read
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[Event]:
        if b"\n" not in chunk:
            self._buf += chunk
            return []
        self._buf += chunk
        *lines, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        return [self._decode(line) for line in lines if line.strip()]

    def end(self) -> list[Event]:
        """The events of an unterminated last line; raises if the stream never said `done`."""
        rest, self._buf = bytes(self._buf), bytearray()
        events = [self._decode(rest)] if rest.strip() else []
        if self.done is None:
            raise ProtocolError(f"rollout stream from {self.url} ended before its done event")
        return events

    def _decode(self, line: bytes | bytearray) -> Event:
        if self.done is not None:
            raise ProtocolError(f"rollout stream from {self.url} went on after its done event")
        try:
            event = _event_decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"bad event line in rollout stream from {self.url}: {exc}") from exc
        if isinstance(event, DoneEvent):
            self.done = event
        elif isinstance(event, GroupFinishedEvent):
            self.groups.append(event.group)
        if self.batch_id is None and event.batch_id:
            self.batch_id = event.batch_id
        return event


class _StreamBase:
    """State shared by both stream iterators: the request, the reader, and what it has seen."""

    def __init__(self, call: Call[Any], url: str) -> None:
        self._call = call
        self._reader = EventReader(url)
        self._pending: deque[Event] = deque()
        self._closed = False

    @property
    def groups(self) -> list[Group]:
        """Finished groups received so far, in finish order."""
        return self._reader.groups

    @property
    def done(self) -> DoneEvent | None:
        """The final event (batch_id, buffered_group_ids, stats) once received."""
        return self._reader.done

    @property
    def batch_id(self) -> str | None:
        """The call's id once its first event was read (every event carries it: what
        `reject` needs while the stream runs); None before that."""
        return self._reader.batch_id


class RolloutStream(_StreamBase):
    """Iterator over a streamed rollout: `GroupFinishedEvent`s as groups finish, then one
    `DoneEvent`. The request goes out on the first `next()`; errors of the call (e.g.
    `InvalidRequest`, or a retried-out `TransportError`) are raised there. Closing early
    ends the HTTP response, which the server treats as a client disconnect."""

    def __init__(
        self, call: Call[Any], url: str, open_response: Callable[[], httpx.Response]
    ) -> None:
        super().__init__(call, url)
        self._open_response = open_response
        self._response: httpx.Response | None = None
        self._chunks: Iterator[bytes] | None = None

    def __iter__(self) -> RolloutStream:
        return self

    def __next__(self) -> Event:
        while not self._pending:
            if self._closed:
                raise StopIteration
            try:
                self._pending.extend(self._read_more())
            except BaseException:
                self.close()
                raise
        event = self._pending.popleft()
        if isinstance(event, DoneEvent):
            self.close()
        return event

    def _read_more(self) -> list[Event]:
        if self._chunks is None:
            self._response = self._open_response()
            self._chunks = self._response.iter_bytes()
        try:
            chunk = next(self._chunks)
        except StopIteration:
            self._closed = True
            return self._reader.end()
        except httpx.RequestError as exc:
            raise TransportError(exc, method=self._call.method, url=self._reader.url) from exc
        return self._reader.feed(chunk)

    def close(self) -> None:
        self._closed = True
        if self._response is not None:
            self._response.close()

    def __enter__(self) -> RolloutStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRolloutStream(_StreamBase):
    """Async iterator twin of `RolloutStream`; close it with `aclose()` or `async with`."""

    def __init__(
        self, call: Call[Any], url: str, open_response: Callable[[], Awaitable[httpx.Response]]
    ) -> None:
        super().__init__(call, url)
        self._open_response = open_response
        self._response: httpx.Response | None = None
        self._chunks: AsyncIterator[bytes] | None = None

    def __aiter__(self) -> AsyncRolloutStream:
        return self

    async def __anext__(self) -> Event:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            try:
                self._pending.extend(await self._read_more())
            except BaseException:
                await self.aclose()
                raise
        event = self._pending.popleft()
        if isinstance(event, DoneEvent):
            await self.aclose()
        return event

    async def _read_more(self) -> list[Event]:
        if self._chunks is None:
            self._response = await self._open_response()
            self._chunks = self._response.aiter_bytes()
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            self._closed = True
            return self._reader.end()
        except httpx.RequestError as exc:
            raise TransportError(exc, method=self._call.method, url=self._reader.url) from exc
        return self._reader.feed(chunk)

    async def aclose(self) -> None:
        self._closed = True
        if self._response is not None:
            await self._response.aclose()

    async def __aenter__(self) -> AsyncRolloutStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
