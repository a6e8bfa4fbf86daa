"""The live `/rollouts` calls by batch id, the batch ids that ended recently, and the
`request_id`s whose attempt is running: what an abort, an answer, the background and a retry
ask about calls, without reaching into the call state machine (`calls/`, a layer above)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Protocol

from april_client.protocol import RejectReq, Sample
from april_server.wire.errors import not_found

# Recent batch ids, so an abort naming a finished call is a no-op, not a 404; bounded, since a
# multi-day run makes millions of calls.
MAX_REMEMBERED_BATCHES = 10_000


class CallView(Protocol):
    """A running call's state as others may read it (`calls.state.CallState`)."""

    @property
    def batch_id(self) -> str: ...
    @property
    def group_ids(self) -> list[str]: ...
    @property
    def stopped(self) -> bool: ...
    @property
    def given_up(self) -> set[str]: ...
    @property
    def closed(self) -> asyncio.Event: ...


class TurnsView(Protocol):
    """What an abort and a tool's answer ask of a call's turns (`calls.turns_in_call`)."""

    def give_up(self, group_ids: set[str] | None) -> None: ...
    def holds_for_input(self, sample: Sample) -> bool: ...
    def continue_answered(self, sample: Sample) -> None: ...


class LiveCall(Protocol):
    """What the rest of the server may ask of a running call (`calls.rollout.RolloutCall`):
    its state, its turns, and a reject."""

    @property
    def state(self) -> CallView: ...
    @property
    def turns(self) -> TurnsView: ...
    def reject(self, body: RejectReq) -> None: ...


class LiveCalls(Mapping[str, LiveCall]):
    def __init__(self) -> None:
        self._live: dict[str, LiveCall] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        # request_id -> the running attempt's encoded response (None: it delivered none)
        self.attempts: dict[str, asyncio.Future[bytes | None]] = {}

    def __getitem__(self, batch_id: str) -> LiveCall:
        return self._live[batch_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def add(self, call: LiveCall) -> None:
        self._live[call.state.batch_id] = call

    def end(self, batch_id: str) -> None:
        """The call is over: it leaves, and is remembered for a while as ended."""
        self._live.pop(batch_id, None)
        self._ended[batch_id] = None
        while len(self._ended) > MAX_REMEMBERED_BATCHES:
            self._ended.popitem(last=False)

    def ended_recently(self, batch_id: str) -> bool:
        return batch_id in self._ended

    def reject(self, batch_id: str, body: RejectReq) -> None:
        """`POST /rollouts/{batch_id}/reject`: 404 for a call that is not running."""
        call = self._live.get(batch_id)
        if call is None:
            raise not_found(f"no running rollout {batch_id!r}")
        call.reject(body)
