"""One engine server on another machine, driven over HTTP (`engine_routes.py` on its side).

Its state is what the owner last learnt: `healthy` (in the pool), `starting` (never answered
yet), `down` (unreachable: a failed probe run, or a connection lost mid-segment), `stale`
(answers, but with other weights than the fleet: out of the pool until it is brought level).
While it is down, every segment in flight on it ends at once with `EngineUnavailable`, so a
partitioned node (whose sockets hang rather than reset) holds nothing up.

Marks and aborts go down one ordered channel (one worker, one POST at a time, batched), so a
mark is in place on the engine before the abort that should trigger it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import httpx

from april_server.engine.base import (
    EngineUnavailable,
    SegmentCall,
    SegmentOutcome,
    SnapshotEngine,
)
from april_server.fleet.engine_wire import (
    ENGINE_PREFIX,
    ControlOp,
    ControlReq,
    EngineInfo,
    KvReq,
    KvResp,
    encoder,
    engine_info,
    kv_resp,
    segment_outcome,
)
from april_server.fleet.lanes import Lanes, MakeClient, new_client
from april_server.rules.inflight import EngineCapacity, StepStat
from april_server.rules.placement import LOCAL, Slot
from april_server.rules.samples import SegmentResult
from april_server.wire.errors import bad_request

T = TypeVar("T")

logger = logging.getLogger(__name__)

State = Literal["starting", "healthy", "down", "stale"]
CONNECT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 10.0  # an engine's event loop answers between scheduler batches
UPDATE_TIMEOUT_S = 1800.0  # loading a large checkpoint from disk


def engine_name(url: str) -> str:
    """A stable name for the engine at `url` (it is recorded in every segment it runs)."""
    return urlsplit(url).netloc or url


class RemoteEngine(SnapshotEngine):
    def __init__(
        self,
        url: str,
        http: httpx.AsyncClient,
        api_key: str | None = None,
        make_client: MakeClient = new_client,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = engine_name(self.url)
        self.http = http  # probes, control, snapshots, weights (segments: `lanes`)
        self.lanes = Lanes(make_client)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.info: EngineInfo | None = None
        self.context_len = 0
        self.vocab_size = None
        self.state: State = "starting"
        self.why = "not probed yet"
        self.failures = 0  # probes failed in a row
        self.since = time.monotonic()  # when it entered its state
        self._down = asyncio.Event()  # set while it is out of reach: segments in flight end
        self._ops: list[ControlOp] = []
        # Snapshot drops the engine did not get (out of reach for a moment): sent again before
        # it serves again, or it would hold those snapshots for good. (key, dp_rank), in order.
        self.unsent_drops: dict[tuple[str, int], None] = {}
        self._ops_ready = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None

    # ---- state ---------------------------------------------------------------------------

    def set_state(self, state: State, why: str = "") -> None:
        if state != self.state:
            logger.warning("april: engine %s: %s -> %s %s", self.name, self.state, state, why)
            self.since = time.monotonic()
        self.state, self.why = state, why
        if state == "down":
            self._down.set()
            self._ops.clear()  # nobody there to stop
        else:
            self._down.clear()

    def learn(self, info: EngineInfo) -> None:
        self.info = info
        self.context_len, self.vocab_size = info.context_len, info.vocab_size
        self.assigns_seeds = info.assigns_seeds
        self.snapshots_enabled = info.snapshots_enabled
        self.routing_format = info.routing_format
        self.sampling_mask_tokens = info.sampling_mask_tokens
        self.failures = 0

    async def probe(self) -> EngineInfo:
        """Ask the engine who it is; raises httpx.HTTPError when it does not answer."""
        resp = await self.http.get(
            self.url + ENGINE_PREFIX + "/info", headers=self.headers, timeout=PROBE_TIMEOUT_S
        )
        resp.raise_for_status()
        info = engine_info.decode(resp.content)
        self.learn(info)
        return info

    def slots(self) -> list[Slot]:
        return [] if self.info is None else [Slot(self.name, r) for r in range(self.info.dp_size)]

    def healthy(self, slot: Slot) -> bool:
        return self.state == "healthy"

    def weight_version(self) -> str:
        return "" if self.info is None else self.info.weight_version

    # ---- segments ------------------------------------------------------------------------

    async def run_segment(self, call: SegmentCall) -> SegmentOutcome:
        if self.state != "healthy":
            raise EngineUnavailable(call.slot, f"{self.state}: {self.why}")
        local = replace(
            call,
            slot=Slot(LOCAL, call.slot.dp_rank),
            drop=None if call.drop is None else Slot(LOCAL, call.drop.dp_rank),
        )
        lane = self.lanes.take()
        post = self.lanes.clients[lane].post(
            self.url + ENGINE_PREFIX + "/segment",
            content=encoder.encode(local),
            headers={**self.headers, "content-type": "application/json"},
            timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None),  # a segment takes long
        )
        try:
            resp = await self.unless_down(post, call.slot)
        except EngineUnavailable:
            self._forget_segment(call)
            raise
        except httpx.TransportError as exc:
            self.set_state("down", f"lost mid-segment: {type(exc).__name__}: {exc}")
            self._forget_segment(call)
            raise EngineUnavailable(call.slot, self.why) from exc
        finally:
            self.lanes.give_back(lane)
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.name}: HTTP {resp.status_code}: {resp.text[:300]}")
        out = segment_outcome.decode(resp.content)
        return replace(out, slot=Slot(self.name, out.slot.dp_rank))

    async def unless_down(self, request: Awaitable[T], slot: Slot) -> T:
        """`request`'s answer, unless a probe marks this engine down first: one that hangs
        without resetting its connections (a lost host, a partition, a stopped process)
        would otherwise hold the caller for the request's whole timeout (a segment has none;
        a weight push 30 min, with every engine's segments held meanwhile; a proxied
        `/generate` none)."""
        work = asyncio.ensure_future(request)
        down = asyncio.ensure_future(self._down.wait())
        try:
            await asyncio.wait({work, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not work.done():
                work.cancel()
        if not work.done() or work.cancelled():
            raise EngineUnavailable(slot, self.why)
        return work.result()

    async def stream_unless_down(
        self, chunks: AsyncIterator[bytes], slot: Slot
    ) -> AsyncIterator[bytes]:
        """`chunks` as they come, ended by `EngineUnavailable` once a probe marks this engine
        down: a stream that stalls with its connection open would hold its reader for good."""
        it = aiter(chunks)
        while True:
            try:
                chunk = await self.unless_down(anext(it), slot)
            except StopAsyncIteration:
                return
            yield chunk

    def _forget_segment(self, call: SegmentCall) -> None:
        """A segment whose answer never came back runs again elsewhere: whatever snapshot of
        its sample the engine may still hold (one its abort left, or the one it restored) is
        known to nobody. If the engine is alive after all (a connection lost under load), drop
        it there before it serves again (`resend_drops`)."""
        if self.snapshots_enabled:
            self.unsent_drops[(call.key, call.slot.dp_rank)] = None

    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        call = SegmentCall(rid, rid, input_ids, sampling_params, Slot(self.name, 0))
        return (await self.run_segment(call)).result

    # ---- marks and aborts: one ordered channel -------------------------------------------

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._send_ops())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        await self.lanes.close()

    def _queue(self, op: ControlOp) -> None:
        if self.state == "down":
            return  # its requests are gone with it
        self._ops.append(op)
        self._ops_ready.set()

    async def _send_ops(self) -> None:
        while True:
            await self._ops_ready.wait()
            self._ops_ready.clear()
            ops, self._ops = self._ops, []
            if not ops:
                continue
            try:
                resp = await self.http.post(
                    self.url + ENGINE_PREFIX + "/control",
                    content=encoder.encode(ControlReq(ops)),
                    headers={**self.headers, "content-type": "application/json"},
                    timeout=PROBE_TIMEOUT_S,
                )
                resp.raise_for_status()
            except httpx.HTTPError as exc:  # aborts are repeated until their segment ends
                logger.warning(
                    "april: engine %s: %d control ops lost: %s", self.name, len(ops), exc
                )

    def mark_snapshot(self, rid: str, key: str, slot: Slot) -> None:
        self.send_mark(rid, key, slot)  # the engine server keeps the marks (it runs segments)

    def send_mark(self, rid: str, key: str, slot: Slot) -> None:
        self._queue(ControlOp("mark", rid, key, slot.dp_rank))

    def abort(self, rid: str) -> None:
        self._queue(ControlOp("abort", rid))

    # ---- snapshots, figures, weights ----------------------------------------------------

    async def _kv(self, op: Any, key: str, slot: Slot, namespace: str | None = None) -> KvResp:
        """Best effort: an engine that does not answer holds nothing we can reach."""
        if self.state == "down":
            return KvResp()
        return await self._post_kv(op, key, slot.dp_rank, namespace) or KvResp()

    async def _post_kv(
        self, op: Any, key: str, dp_rank: int, namespace: str | None = None
    ) -> KvResp | None:
        """One `/kv` op; None (logged) when the engine did not take it."""
        try:
            resp = await self.http.post(
                self.url + ENGINE_PREFIX + "/kv",
                content=encoder.encode(KvReq(op, key, dp_rank, namespace)),
                headers={**self.headers, "content-type": "application/json"},
                timeout=PROBE_TIMEOUT_S * 6,
            )
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("april: engine %s: kv %s %s failed: %s", self.name, op, key, exc)
            return None
        return kv_resp.decode(resp.content)

    async def restore_snapshot(self, key: str, slot: Slot, namespace: str | None = None) -> int:
        return (await self._kv("restore", key, slot, namespace)).restored

    async def release_snapshot(self, key: str, slot: Slot) -> None:
        await self._kv("release", key, slot)

    async def drop_snapshot(self, key: str, slot: Slot) -> None:
        if self.state == "down" or not await self._send_drop(key, slot.dp_rank):
            self.unsent_drops[(key, slot.dp_rank)] = None

    async def _send_drop(self, key: str, dp_rank: int) -> bool:
        return await self._post_kv("drop", key, dp_rank) is not None

    async def resend_drops(self) -> None:
        """Send the drops it missed; called after a probe answered, before it serves again (a
        restarted engine holds none of those snapshots: the drops are no-ops there)."""
        for key, rank in list(self.unsent_drops):
            if not await self._send_drop(key, rank):
                return  # still out of reach: the next probe tries again
            self.unsent_drops.pop((key, rank), None)

    async def snapshot_info(self, key: str, slot: Slot) -> dict[str, Any] | None:
        return (await self._kv("info", key, slot)).info

    async def figures(self) -> dict[str, Any]:
        """Snapshot stats, capacity, step curve and clock (empty when it does not answer)."""
        if self.state == "down":
            return {}
        try:
            resp = await self.http.get(
                self.url + ENGINE_PREFIX + "/figures", headers=self.headers, timeout=PROBE_TIMEOUT_S
            )
            resp.raise_for_status()
            out: dict[str, Any] = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("april: engine %s: figures: %s", self.name, exc)
            return {}
        return out

    async def snapshot_keys(self) -> dict[Slot, dict[str, float]]:
        if not self.snapshots_enabled:
            return {}
        got = await self._post_kv("keys", "", -1)  # None: it did not answer, nothing swept
        ranks = {} if got is None or got.info is None else got.info
        return {Slot(self.name, int(r)): dict(ages) for r, ages in ranks.items()}

    async def snapshot_stats(self) -> dict[str, Any]:
        return dict((await self.figures()).get("snapshots") or {})

    async def capacity(self) -> EngineCapacity | None:
        cap = (await self.figures()).get("capacity")
        return None if not cap else EngineCapacity(int(cap[0]), int(cap[1]))

    async def step_curve(self) -> dict[int, float | StepStat]:
        raw = (await self.figures()).get("step_curve") or {}
        return {
            int(b): StepStat(int(v[0]), *map(float, v[1:])) if isinstance(v, list) else float(v)
            for b, v in raw.items()
        }

    async def engine_clock(self) -> dict[str, float]:
        return {k: float(v) for k, v in ((await self.figures()).get("clock") or {}).items()}

    async def update_weights(
        self, body: dict[str, Any], path: str = "/update_weights_from_disk"
    ) -> dict[str, Any]:
        """SGLang's own weight route `path` on the engine server (disk, or a broadcast's
        receiving end: `/update_weights_from_distributed`, the session's begin and end, the
        group's init and destroy); raises unless it succeeded."""
        post = self.http.post(
            self.url + path,
            json=body,
            headers=self.headers,
            timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=UPDATE_TIMEOUT_S),
        )
        resp = await self.unless_down(post, Slot(self.name, 0))
        out: dict[str, Any] = resp.json() if resp.content else {}
        if resp.status_code != 200 or out.get("success") is False:
            raise RuntimeError(f"HTTP {resp.status_code}: {out.get('message', resp.text[:300])}")
        return out

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        raise bad_request("no_tokenizer", "tokenization happens on the owner")

    def check_sampling_params(self, params: dict[str, Any]) -> None:
        from april_server.door.engine import check_sampling_params

        check_sampling_params(params, self.vocab_size)

    def describe(self) -> dict[str, Any]:
        """For /stats: where it is and what the owner knows of it."""
        info = self.info
        return {
            "engine": self.name,
            "url": self.url,
            "state": self.state,
            "why": self.why,
            "for_s": round(time.monotonic() - self.since, 1),
            "weight_version": None if info is None else info.weight_version,
            "dp_size": None if info is None else info.dp_size,
            "model_path": None if info is None else info.model_path,
        }
