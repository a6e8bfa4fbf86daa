"""The simulated engine: the fake engine's tokens (a hash of the context, so any interruption
resumes to the same tokens), with seeded step times, slow steps and injected failures, and a
watch that fails the run if one sample ever has two requests at once.

With faults (`EngineFaults`, chosen per seed) it is also:
- an owner over several engines (one slot each) whose weight push may fail on one of them,
  which is then `stale` (no new segment starts there) until a probe brings it level;
- an engine whose segments fail part-way (some tokens out, then an error; on an owner, the
  connection to its engine lost: `EngineUnavailable`, the segment runs again elsewhere);
- an engine that hangs for a while: no step, no abort, no snapshot operation lands;
- slow on every operation that suspends in the real engine (snapshot drop, restore, release,
  info, listing) and on a mark's way to the scheduler (it lands before the abort sent after it,
  as on SGLang's one channel, or not at all if the request ended first);
- a KV snapshot store per slot (the snapshot is the context it was taken at), restored as the
  tokens it holds; an engine that returns routed experts (a hash of the context and version).
Every request is logged (`requests`): which owner planned it, under which version it started,
so the ledger can judge a delivered sample's segments by the rule of the call that made them.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from dataclasses import dataclass, field, replace
from typing import Any

from april_server.engine.base import EngineUnavailable, SegmentCall, SegmentOutcome
from april_server.rules.inflight import EngineCapacity
from april_server.rules.placement import Slot
from april_server.rules.routing_replay import RoutingRows
from april_server.rules.samples import SegmentResult
from april_server.rules.stops import stop_strings
from tests.unit.fake_engine import EOS, SnapshotFakeEngine, next_token

ROUTING = (2, 2, "uint8")  # (MoE layers, top_k, dtype) of the simulated routed experts
EXPERTS = 8


@dataclass
class EngineFaults:
    """Seeded engine faults; the defaults are the engine as it was before faults existed."""

    on: bool = False  # False: exactly the earlier engine (no draw of the seed's generator)
    engines: int = 1  # > 1: an owner over that many engines
    part_fail_p: float = 0.0  # a segment fails part-way
    op_delay_s: float = 0.0  # the most a snapshot operation (or a mark) takes
    hangs: list[tuple[float, float]] = field(default_factory=list)  # (from, to), virtual s
    push_fail_p: float = 0.0  # a push fails on one engine of an owner
    capacity: EngineCapacity | None = None
    routing: bool = False


@dataclass(frozen=True)
class Request:
    rid: str
    sample_id: str
    owner: str  # who planned it (the rid says)
    index: int  # the segment it would record (the sample's segments when planned)
    version: str  # the weights it started under
    context: int  # tokens it was sent


def parse_rid(rid: str) -> tuple[str, str, int]:
    """(sample id, owner, segment index) of `{sample}@{owner}.{index}.{hex}`."""
    sid, _, rest = rid.partition("@")
    owner, index, _ = rest.rsplit(".", 2)
    return sid, owner, int(index)


def routed(context: list[int], version: str) -> bytes:
    """The experts position `len(context) - 1` is routed to under `version`: one row."""
    layers, top_k, _ = ROUTING
    digest = hashlib.blake2b(repr((context[-6:], len(context), version)).encode(), digest_size=8)
    return bytes(b % EXPERTS for b in digest.digest()[: layers * top_k])


class SimEngine(SnapshotFakeEngine):
    def __init__(self, rng: random.Random, faults: EngineFaults | None = None) -> None:
        super().__init__()
        self.rng = rng
        self.faults = faults or EngineFaults()
        self.fail_p = 0.0  # chance that a request fails outright (an engine error)
        self.slow_p = 0.02  # chance that a decode step takes 20-100x longer
        self.live: dict[str, str] = {}  # sample id -> its request now
        self.double: list[str] = []
        self.requests: dict[str, list[Request]] = {}  # sample id -> its requests, in order
        self.failed: set[str] = set()  # requests that ended by an engine error
        # With faults: snapshots by (slot, key) -> the context they hold; marks by rid.
        self.held: dict[tuple[Slot, str], list[int]] = {}
        self.marked: dict[str, tuple[str, Slot, float]] = {}  # rid -> key, slot, lands at
        self.stale: set[str] = set()  # engines a failed push left behind
        self._slot_of: dict[str, Slot] = {}
        self._contexts: dict[str, list[int]] = {}
        self.events: list[str] = []  # with faults: what happened to snapshots (`--verbose`)
        if self.faults.routing:
            self.routing_format = ROUTING  # type: ignore[assignment]

    @property  # type: ignore[override]
    def delay_s(self) -> float:  # one decode step
        if self.rng.random() < self.slow_p:
            return self.rng.uniform(0.02, 0.1)
        return self.rng.uniform(0.0005, 0.002)

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        pass

    # ---- what the ledger reads ----------------------------------------------------------------

    def snapshots(self) -> set[tuple[Slot, str]]:
        """Every snapshot held now, by (slot, key)."""
        if not self.faults.on:
            return {(Slot(), key) for key in self.snaps}
        return set(self.held)

    def requests_of(self, sample_id: str) -> list[Request]:
        return self.requests.get(sample_id, [])

    def failed_last(self, sample_id: str) -> bool:
        """Whether the sample's last request ended by an engine error (the background then
        leaves its group to the next call: it does not retry against a failing engine)."""
        reqs = self.requests.get(sample_id)
        return bool(reqs) and reqs[-1].rid in self.failed

    # ---- the owner's engines ------------------------------------------------------------------

    def slots(self) -> list[Slot]:
        if self.faults.engines <= 1:
            return [Slot()]
        return [Slot(f"e{i}", 0) for i in range(self.faults.engines)]

    def healthy(self, slot: Slot) -> bool:
        return slot.engine not in self.stale

    def capacity_key(self) -> object:
        if not self.faults.on:
            return super().capacity_key()
        return tuple(sorted(s.engine for s in self.slots() if self.healthy(s)))

    async def capacity(self) -> EngineCapacity | None:
        return self.faults.capacity

    # ---- one segment --------------------------------------------------------------------------

    async def run_segment(self, call: SegmentCall) -> SegmentOutcome:
        if self.faults.on and not self.healthy(call.slot):
            raise EngineUnavailable(call.slot, "stale: its weights are behind")
        return await super().run_segment(call)

    async def generate_on(self, slot: Slot, call: SegmentCall) -> SegmentResult:
        if not self.faults.on:
            return await self.generate(call.rid, call.input_ids, call.sampling_params)
        self._slot_of[call.rid] = slot
        try:
            result = await self.generate(call.rid, call.input_ids, call.sampling_params)
        finally:
            self._slot_of.pop(call.rid, None)
        if call.routing_start is None or self.routing_format is None:
            return result
        context = self._contexts.pop(call.rid, list(call.input_ids) + result.output_ids)
        start = call.routing_start
        fed = len(call.input_ids) + len(result.output_ids) - 1
        rows = b"".join(routed(context[: p + 1], result.weight_version) for p in range(start, fed))
        layers, top_k, dtype = ROUTING
        routing = RoutingRows(start, rows, layers, top_k, dtype)  # type: ignore[arg-type]
        return replace(result, routing_asked=start, routing=routing)

    async def generate(self, rid: str, ids: list[int], params: dict[str, Any]) -> Any:
        sid, owner, index = parse_rid(rid)
        reqs = self.requests.setdefault(sid, [])
        reqs.append(Request(rid, sid, owner, index, self.version, len(ids)))
        if sid in self.live:
            self.double.append(f"{sid}: {self.live[sid]} and {rid}")
        self.live[sid] = rid
        try:
            if self.fail_p and self.rng.random() < self.fail_p:
                raise RuntimeError("simulated engine error")
            if not self.faults.on:
                return await super().generate(rid, ids, params)
            return await self._generate(rid, ids, params)
        except RuntimeError:
            self.failed.add(rid)
            raise
        finally:
            if self.live.get(sid) == rid:
                del self.live[sid]

    async def _generate(self, rid: str, ids: list[int], params: dict[str, Any]) -> SegmentResult:
        """The fake engine's generation, with hangs and part-way failures."""
        faults, rng = self.faults, self.rng
        budget = params["max_new_tokens"]
        fail_at = None
        if faults.part_fail_p and rng.random() < faults.part_fail_p:
            fail_at = rng.randint(0, budget)
        ctx, out = list(ids), []
        finish, matched = "length", None
        stops = set(params.get("stop_token_ids") or [])
        plain = not params.get("ignore_eos", False)
        while len(out) < budget:
            await asyncio.sleep(self.delay_s)
            await self._unhung()
            if fail_at is not None and len(out) >= fail_at:
                self._end_mark(rid, None)
                if self.faults.engines > 1 and rng.random() < 0.5:
                    slot = self._slot_of.get(rid, Slot())
                    raise EngineUnavailable(slot, "simulated: connection lost mid-segment")
                raise RuntimeError("simulated: engine failed part-way")
            if rid in self.aborted:
                finish = "abort"
                break
            tok = next_token(ctx, self.vocab_size)
            out.append(tok)
            ctx.append(tok)
            if plain and (tok == EOS or tok in stops):
                finish, matched = "stop", tok
                break
            text = self.detokenize(out) or ""
            hit = [s for s in stop_strings(params) if s in text]
            if hit:
                finish, matched = "stop", hit[0]
                break
        self._end_mark(rid, ctx[:-1] if finish == "abort" else None)
        self._contexts[rid] = ctx
        lps = [-0.01 * (t % 7) for t in out]
        return SegmentResult(out, lps, finish, self.version, cached_tokens=0, matched=matched)

    # ---- snapshots ----------------------------------------------------------------------------

    def send_mark(self, rid: str, key: str, slot: Slot) -> None:
        if not self.faults.on:
            super().send_mark(rid, key, slot)
            return
        lands = asyncio.get_running_loop().time()
        self._event(f"mark {key} on {slot.engine} for {rid}")
        if self.faults.op_delay_s:
            lands += self.rng.uniform(0, self.faults.op_delay_s)
        self.marked[rid] = (key, slot, lands)

    def abort(self, rid: str) -> None:
        super().abort(rid)
        mark = self.marked.get(rid)
        if mark is not None:  # one channel: a mark sent before the abort lands before it
            self.marked[rid] = (mark[0], mark[1], min(mark[2], asyncio.get_running_loop().time()))

    def _end_mark(self, rid: str, kv: list[int] | None) -> None:
        """The request ended: a landed mark of one that ended by abort keeps its KV (`kv`)."""
        mark = self.marked.pop(rid, None)
        if mark is None or kv is None:
            return
        key, slot, lands = mark
        if lands <= asyncio.get_running_loop().time():
            self.held[(slot, key)] = kv
            self._event(f"taken {key} on {slot.engine} ({len(kv)} tokens) by {rid}")

    def _event(self, what: str) -> None:
        t = asyncio.get_running_loop().time() - 1_000_000.0
        self.events.append(f"{t:9.4f} {what}")

    async def _op(self) -> None:
        """A snapshot operation's trip to the scheduler (and back), hangs included; one in ten
        meets a scheduler busy for 5-10 times as long."""
        if self.faults.op_delay_s:
            slow = self.rng.uniform(5, 10) if self.rng.random() < 0.1 else 1.0
            await asyncio.sleep(self.rng.uniform(0, self.faults.op_delay_s) * slow)
        await self._unhung()

    async def _unhung(self) -> None:
        for start, end in self.faults.hangs:
            now = asyncio.get_running_loop().time()
            if start <= now < end:
                await asyncio.sleep(end - now)

    async def restore_snapshot(self, key: str, slot: Slot, namespace: str | None = None) -> int:
        if not self.faults.on:
            return await super().restore_snapshot(key, slot, namespace)
        await self._op()
        kv = self.held.get((slot, key))
        self._event(f"restore {key} on {slot.engine}: {0 if kv is None else len(kv)}")
        return 0 if kv is None else len(kv)

    async def release_snapshot(self, key: str, slot: Slot) -> None:
        if not self.faults.on:
            return await super().release_snapshot(key, slot)
        await self._op()

    async def drop_snapshot(self, key: str, slot: Slot) -> None:
        if not self.faults.on:
            return await super().drop_snapshot(key, slot)
        self._event(f"drop {key} on {slot.engine} sent")
        await self._op()
        self._event(f"drop {key} on {slot.engine}: {self.held.pop((slot, key), None) is not None}")

    async def snapshot_info(self, key: str, slot: Slot) -> dict[str, Any] | None:
        if not self.faults.on:
            return await super().snapshot_info(key, slot)
        self.info_asked += 1
        await self._op()
        kv = self.held.get((slot, key))
        return None if kv is None else {"tokens": len(kv), "bytes": 100}

    async def snapshot_keys(self) -> dict[Slot, dict[str, float]]:
        if not self.faults.on:
            return await super().snapshot_keys()
        await self._op()
        out: dict[Slot, dict[str, float]] = {s: {} for s in self.slots()}
        for slot, key in self.held:
            out.setdefault(slot, {})[key] = 0.0
        return out

    async def snapshot_stats(self) -> dict[str, Any]:
        if not self.faults.on:
            return await super().snapshot_stats()
        return {"snapshot_bytes": 100 * len(self.held)}

    # ---- a push on an owner -------------------------------------------------------------------

    def push_fails_on(self) -> str | None:
        """The engine a push fails on, if it fails on one (it is stale from now on)."""
        if self.faults.engines > 1 and self.rng.random() < self.faults.push_fail_p:
            name = self.rng.choice(self.slots()).engine
            self.stale.add(name)
            return name
        return None
