"""The owner's HTTP clients for one engine server's segments: lanes of at most `LANE_SIZE`.

A remote engine sends its probes, control messages, snapshots and weights on one shared client
and its segments on `Lanes`, clients it adds as load grows (`remote.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

# Segments per httpx client. httpcore's pool checks every one of its connections (a syscall
# each) on every request and response: with all segments in one pool that is quadratic in the
# segments in flight, and it was over half the owner's CPU (py-spy, 64 segments in flight).
LANE_SIZE = 16
MakeClient = Callable[[], httpx.AsyncClient]


# An engine server (SGLang's uvicorn) closes a connection idle for SGLANG_TIMEOUT_KEEP_ALIVE,
# 5 s by default, and httpx keeps one for 5 s too: a segment sent down a connection the engine
# is closing at that moment fails with a ReadError, and the engine was marked down for it (owner
# chaos: 65-400 ms outages under load, each re-running its segments elsewhere). Ours expire first.
KEEPALIVE_EXPIRY_S = 2.0


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=64,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
    )


class Lanes:
    """Clients for segments, at most LANE_SIZE in flight on each: new ones as load grows."""

    def __init__(self, make_client: MakeClient) -> None:
        self.make_client = make_client
        self.clients: list[httpx.AsyncClient] = []
        self.busy: list[int] = []

    def take(self) -> int:
        free = [i for i, n in enumerate(self.busy) if n < LANE_SIZE]
        if free:
            i = min(free, key=lambda j: self.busy[j])
        else:
            self.clients.append(self.make_client())
            self.busy.append(0)
            i = len(self.clients) - 1
        self.busy[i] += 1
        return i

    def give_back(self, i: int) -> None:
        self.busy[i] -= 1

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()
        self.clients, self.busy = [], []
