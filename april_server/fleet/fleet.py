"""`FleetEngine`: many engine servers as one `SnapshotEngine`, for the owner's manager.

What is global and what is per engine:
- global (the owner): the quota, the durable buffer, the in-flight policy and admission (on the
  fleet's summed capacity and aggregated step curve), placement (`placement.py`, over every
  engine's DP ranks), and the weight version every new segment runs under;
- per engine: generation, its KV pool, and the KV snapshots of samples it interrupted (a
  continuation goes back to the engine holding its snapshot).

Health: every engine is probed each `interval_s`; `down_after` failed probes in a row, or a
connection lost mid-segment, take it out of the pool (`down`): its segments in flight end at once
(`EngineUnavailable`) and run again elsewhere (`segment_runner.py`), its snapshots are given up. It
rejoins when it answers again with the fleet's weight version; with another version it is
`stale` and is brought level by replaying the last weight update, if there was one.

Weight updates go through the part the fleet holds for them (`weights`, a `WeightPush`:
`weight_push.py`) to every reachable engine at once; new segments wait until all have answered,
and the fleet's version changes only to one every engine in the pool reports.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from april_client.protocol import WeightGroupInfo
from april_server.engine.base import EngineUnavailable, SegmentCall, SegmentOutcome, SnapshotEngine
from april_server.fleet.lanes import MakeClient, new_client
from april_server.fleet.remote import RemoteEngine, engine_name
from april_server.fleet.weight_push import WeightPush
from april_server.rules.inflight import EngineCapacity, StepStat, aggregate_curve
from april_server.rules.placement import Slot
from april_server.rules.ranks import merge_rank_stats
from april_server.rules.samples import SegmentResult
from april_server.wire.errors import bad_request

logger = logging.getLogger(__name__)

Discover = Callable[[], Awaitable[list[str]]]
LEFT_REGISTRY = "left the registry"
FORGET_AFTER_ROUNDS = 30  # probe rounds (1 s each) an engine may be missing before it is dropped


class FleetEngine(SnapshotEngine):
    def __init__(
        self,
        urls: Sequence[str] = (),
        discover: Discover | None = None,
        api_key: str | None = None,
        tokenizer_path: str | None = None,
        interval_s: float = 1.0,
        down_after: int = 3,
        make_client: MakeClient = new_client,
    ) -> None:
        """`urls`: a static list of engine servers; `discover`: returns the current list (smg's
        worker registry), asked on every probe round; either or both."""
        self.make_client = make_client
        self.http = make_client()  # probes, control, proxied routes (segments: per engine)
        self.api_key = api_key
        self.discover = discover
        self.interval_s = interval_s
        self.down_after = down_after
        self.members: dict[str, RemoteEngine] = {}
        for url in urls:
            self._add(url)
        self._static = set(self.members)  # given on the command line: never dropped
        self._absent: dict[str, int] = {}  # discovered engines: rounds missing from the registry
        # the fleet's weight version, its pushes, and the new segments they hold back
        self.weights = WeightPush(self.members)
        self.context_len = 0
        self.vocab_size = None
        self.tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._first_lock = asyncio.Lock()
        self._syncing: set[str] = set()
        self._rids: dict[str, RemoteEngine] = {}  # segments in flight -> their engine
        self._held: dict[str, asyncio.Event] = {}  # segments a weight update holds back
        self._loop: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # some engine answered: sizes and version are known

    def _add(self, url: str) -> RemoteEngine:
        name = engine_name(url)
        if name not in self.members:
            self.members[name] = RemoteEngine(url, self.http, self.api_key, self.make_client)
        return self.members[name]

    # ---- lifecycle and health -----------------------------------------------------------

    async def start(self) -> None:
        for m in self.members.values():
            m.start()
        self._loop = asyncio.get_running_loop().create_task(self._health_loop())

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        for m in self.members.values():
            await m.stop()
        await self.http.aclose()

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # the loop must outlive any one bad round
                logger.exception("april: fleet health round failed")
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        if self.discover is not None:
            await self._rediscover()
        await asyncio.gather(*(self._probe(m) for m in list(self.members.values())))

    async def _rediscover(self) -> None:
        try:
            urls = await self.discover()  # type: ignore[misc]
        except Exception as exc:
            logger.warning("april: engine discovery failed (pool unchanged): %s", exc)
            return
        listed = {engine_name(u) for u in urls}
        for url in urls:
            name = engine_name(url)
            self._absent.pop(name, None)
            if name not in self.members:
                self._add(url).start()
            elif self.members[name].why == LEFT_REGISTRY:
                # Registered again: probed from now on, and serves once healthy.
                self.members[name].set_state("down", "back in the registry")
                self.members[name].failures = 0
        for name, m in list(self.members.items()):
            if name in listed or name in self._static:
                continue  # given on the command line: served whatever the registry says
            if m.state != "down":
                m.set_state("down", LEFT_REGISTRY)
            self._absent[name] = self._absent.get(name, 0) + 1
            if self._absent[name] >= FORGET_AFTER_ROUNDS:
                # Gone for good: dropped, like a dead engine (its snapshots went with it).
                del self.members[name], self._absent[name]
                await m.stop()
                logger.warning("april: engine %s left the registry: dropped", name)

    async def _probe(self, m: RemoteEngine) -> None:
        if self.discover is not None and m.why == LEFT_REGISTRY:
            return
        try:
            info = await m.probe()
        except (httpx.HTTPError, ValueError) as exc:
            m.failures += 1
            refused = isinstance(exc, httpx.ConnectError)
            if m.state != "down" and (refused or m.failures >= self.down_after):
                m.set_state("down", f"probe failed: {type(exc).__name__}: {exc}")
            return
        if m.unsent_drops:  # before it serves again: a new snapshot could reuse a key
            await m.resend_drops()
        weights = self.weights
        if weights.updating():
            return  # versions are in motion: the update itself settles every engine's state
        if weights.version is None:
            weights.version = info.weight_version
        if not self.ready.is_set():
            await self._first_engine(m)
        self._fit_sizes()
        if info.weight_version == weights.version:
            m.set_state("healthy")
        elif weights.last_update is not None and m.name not in self._syncing:
            m.set_state(
                "stale", f"weights {info.weight_version!r}, the fleet's {weights.version!r}"
            )
            self._syncing.add(m.name)
            asyncio.get_running_loop().create_task(self._bring_level(m, weights.last_update))
        elif m.name not in self._syncing:
            m.set_state(
                "stale",
                f"weights {info.weight_version!r}, the fleet's {weights.version!r}: push weights "
                "(POST /update_weights_from_disk, or a broadcast to a weight-update group it "
                "is in: GET /april/v1/weights/group) to bring them level",
            )

    async def _bring_level(self, m: RemoteEngine, body: dict[str, Any]) -> None:
        try:
            await m.update_weights(body)
            logger.warning("april: engine %s: replayed the last weight update", m.name)
        except Exception as exc:
            logger.warning("april: engine %s: replaying the weight update failed: %s", m.name, exc)
        finally:
            self._syncing.discard(m.name)  # the next probe decides

    async def _first_engine(self, m: RemoteEngine) -> None:
        # Once, even when several engines answer the first round together (two threads
        # importing transformers at once can leave it half-imported for good).
        async with self._first_lock:
            if self.ready.is_set():
                return
            info = m.info
            assert info is not None
            self.assigns_seeds = info.assigns_seeds
            self.snapshots_enabled = info.snapshots_enabled
            self.eos_token_ids = frozenset(info.eos_token_ids)
            path = self.tokenizer_path or (info.model_path if info.has_tokenizer else None)
            if path and Path(path).exists():  # loading reads files: off the event loop
                try:
                    self._tokenizer = await asyncio.to_thread(load_tokenizer, path)
                except Exception as exc:  # text prompts are refused; input_ids still work
                    logger.warning("april: no tokenizer from %s: %s", path, exc)
            self.ready.set()

    def _fit_sizes(self) -> None:
        """The fleet accepts what every engine it knows can run."""
        infos = [m.info for m in self.members.values() if m.info is not None]
        self.context_len = min(i.context_len for i in infos)
        vocab = {i.vocab_size for i in infos}
        self.vocab_size = vocab.pop() if len(vocab) == 1 else None
        # Routing only when every engine returns it alike: a sample may run on any of them.
        formats = {i.routing_format for i in infos}
        self.routing_format = formats.pop() if len(formats) == 1 else None
        # Masks only when every engine returns them; a row may be as large as any one allows.
        bounds = [i.sampling_mask_tokens for i in infos]
        self.sampling_mask_tokens = None if None in bounds else min(b for b in bounds if b)

    def member(self, slot: Slot) -> RemoteEngine | None:
        return self.members.get(slot.engine)

    def pool(self) -> list[RemoteEngine]:
        return [m for m in self.members.values() if m.state == "healthy"]

    def capacity_key(self) -> object:
        return tuple(sorted(m.name for m in self.pool()))

    def weight_group(self) -> WeightGroupInfo:
        return self.weights.group()

    # ---- BaseEngine ---------------------------------------------------------------------

    def slots(self) -> list[Slot]:
        return [s for m in self.members.values() for s in m.slots()]

    def healthy(self, slot: Slot) -> bool:
        m = self.member(slot)
        return m is not None and m.state == "healthy"

    def weight_version(self) -> str:
        return self.weights.version or ""

    def detokenize(self, ids: list[int]) -> str | None:
        return None if self._tokenizer is None else str(self._tokenizer.decode(ids))

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        if self._tokenizer is None:
            raise bad_request(
                "no_tokenizer",
                "the owner has no tokenizer (its engines' model path is not on this machine): "
                "send input_ids, or start it with --april-tokenizer PATH",
            )
        return list(self._tokenizer.encode(text, add_special_tokens=special))

    def check_sampling_params(self, params: dict[str, Any]) -> None:
        from april_server.door.engine import check_sampling_params

        check_sampling_params(params, self.vocab_size)

    async def run_segment(self, call: SegmentCall) -> SegmentOutcome:
        if self.weights.held() and await self._held_until_updated(call.rid):
            # Stopped while a weight update held it back: it never reached an engine, so
            # the old snapshot its plan gave up must be freed here (nobody else knows of it).
            if call.drop is not None:
                await self.drop_snapshot(call.key, call.drop)
            result = SegmentResult([], [], "abort", self.weight_version())
            return SegmentOutcome(result, call.slot)
        m = self.member(call.slot)
        if m is None:
            raise EngineUnavailable(call.slot, "not in the fleet")
        if call.drop is not None and call.drop.engine != m.name:
            await self.drop_snapshot(call.key, call.drop)
            call = replace(call, drop=None)
        self._rids[call.rid] = m
        try:
            return await m.run_segment(call)
        finally:
            self._rids.pop(call.rid, None)

    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        slot = min(self.slots(), key=lambda s: (not self.healthy(s), s))
        call = SegmentCall(rid, rid, input_ids, sampling_params, slot)
        return (await self.run_segment(call)).result

    async def _held_until_updated(self, rid: str) -> bool:
        """Wait while a weight update reaches every engine; True if `rid` was aborted
        meanwhile (an abort or a quota wind-down never waits for weights)."""
        stop = self._held[rid] = asyncio.Event()
        waits = [asyncio.ensure_future(self.weights.released()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            self._held.pop(rid, None)
        return stop.is_set()

    def abort(self, rid: str) -> None:
        m = self._rids.get(rid)
        if m is not None:
            m.abort(rid)
        elif (held := self._held.get(rid)) is not None:
            held.set()

    # ---- snapshots: where they live -----------------------------------------------------

    def send_mark(self, rid: str, key: str, slot: Slot) -> None:
        m = self.member(slot)
        if m is not None:
            m.send_mark(rid, key, slot)

    def mark_snapshot(self, rid: str, key: str, slot: Slot) -> None:
        self.send_mark(rid, key, slot)

    async def restore_snapshot(self, key: str, slot: Slot, namespace: str | None = None) -> int:
        m = self.member(slot)
        return 0 if m is None else await m.restore_snapshot(key, slot, namespace)

    async def release_snapshot(self, key: str, slot: Slot) -> None:
        m = self.member(slot)
        if m is not None:
            await m.release_snapshot(key, slot)

    async def drop_snapshot(self, key: str, slot: Slot) -> None:
        m = self.member(slot)
        if m is not None:
            await m.drop_snapshot(key, slot)

    async def snapshot_info(self, key: str, slot: Slot) -> dict[str, Any] | None:
        m = self.member(slot)
        return None if m is None else await m.snapshot_info(key, slot)

    async def snapshot_keys(self) -> dict[Slot, dict[str, float]]:
        out: dict[Slot, dict[str, float]] = {}
        for held in await asyncio.gather(*(m.snapshot_keys() for m in self.pool())):
            out.update(held)
        return out

    # ---- figures ------------------------------------------------------------------------

    async def _figures(self) -> list[tuple[RemoteEngine, dict[str, Any]]]:
        pool = self.pool()
        got = await asyncio.gather(*(m.figures() for m in pool))
        return list(zip(pool, got, strict=True))

    async def snapshot_stats(self) -> dict[str, Any]:
        per = [(m, f.get("snapshots") or {}) for m, f in await self._figures()]
        merged = merge_rank_stats([s for _, s in per])
        merged.pop("dp_ranks", None)
        merged["engines"] = [{"engine": m.name, **s} for m, s in per]
        return merged

    async def capacity(self) -> EngineCapacity | None:
        caps = [c for c in await asyncio.gather(*(m.capacity() for m in self.pool())) if c]
        if not caps:
            return None
        return EngineCapacity(
            sum(c.max_running_requests for c in caps), sum(c.max_total_tokens for c in caps)
        )

    async def step_curve(self) -> dict[int, StepStat]:
        curves = await asyncio.gather(*(m.step_curve() for m in self.pool()))
        stats = [{b: v for b, v in c.items() if isinstance(v, StepStat)} for c in curves]
        return aggregate_curve([c for c in stats if c])  # engines step side by side

    async def engine_clock(self) -> dict[str, float]:
        clocks = await asyncio.gather(*(m.engine_clock() for m in self.pool()))
        return {k: float(v) for k, v in merge_rank_stats(clocks).items()}

    def engine_stats(self) -> dict[str, Any]:
        return {
            "context_len": self.context_len,
            "vocab_size": self.vocab_size,
            "engines": [m.describe() for m in self.members.values()],
            "healthy_engines": len(self.pool()),
        }


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
