"""A deterministic in-process engine for unit tests of the bookkeeping (not of SGLang).

The next token is a hash of the whole context, so an interrupted + resumed sample produces
exactly the tokens of an uninterrupted one: the same oracle as the real engine tests use.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from april_server.engine.base import BaseEngine, SegmentCall, SnapshotEngine
from april_server.engine.segment_planner import SegmentPlanner
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import Counters, Running
from april_server.engine.snapshot_places import SnapshotPlaces
from april_server.engine.versions import WeightVersions
from april_server.engine.weight_cut import WeightCut
from april_server.rules import sampling_mask as mask_rules
from april_server.rules.inflight import Admission
from april_server.rules.lengths import LengthModel
from april_server.rules.placement import Slot
from april_server.rules.samples import SegmentResult
from april_server.rules.stops import stop_strings
from april_server.wire.errors import bad_request

EOS = 2
KNOWN_PARAMS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "ignore_eos",
    "stop_token_ids",
    "stop",
    "sampling_seed",
}


def next_token(context: list[int], vocab: int) -> int:
    digest = hashlib.blake2b(repr(context[-8:] + [len(context)]).encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "little") % vocab


def kept_set(context: list[int], token: int, vocab: int) -> list[int]:
    """The fake sampler's kept set when it drew `token` after `context`: the token and a few
    others, a pure function of the context (so a resumed sample keeps an uninterrupted one's)."""
    h = next_token(context + [vocab], vocab)
    return sorted({token, (token + 1) % vocab, h, (h * 3 + len(context)) % vocab})


def kept_logprob(context: list[int], token: int, vocab: int) -> float:
    return -0.125 * len(kept_set(context, token, vocab))


class FakeEngine(BaseEngine):
    eos_token_ids = frozenset({EOS})
    sampling_mask_tokens = 16

    def __init__(self, delay_s: float = 0.001, vocab: int = 64, context_len: int = 512) -> None:
        self.delay_s = delay_s
        self.vocab_size = vocab
        self.context_len = context_len
        self.version = "0"
        self.aborted: set[str] = set()
        self.active: set[str] = set()
        self.calls: list[tuple[str, list[int], dict[str, Any]]] = []
        self.fail_rids: set[str] = set()
        # (rid, output length) -> whether an abort lands in the step that produced that token:
        # SGLang then says `abort` whatever the token was (its `to_finish` wins the step).
        self.abort_in_step: Callable[[str, int], bool] | None = None

    def detokenize(self, ids: list[int]) -> str | None:
        return "".join(chr(0x30 + t) for t in ids)  # one character per token

    def weight_version(self) -> str:
        return self.version

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def check_sampling_params(self, params: dict[str, Any]) -> None:
        unknown = set(params) - KNOWN_PARAMS
        if unknown:
            raise bad_request("invalid_sampling_params", f"unknown: {sorted(unknown)}")

    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        self.calls.append((rid, list(input_ids), dict(sampling_params)))
        if any(r in rid for r in self.fail_rids):
            raise RuntimeError("injected engine failure")
        self.active.add(rid)
        ctx = list(input_ids)
        out: list[int] = []
        budget = sampling_params["max_new_tokens"]
        finish = "length"
        matched: int | None = None
        stops = set(sampling_params.get("stop_token_ids") or [])
        try:
            while len(out) < budget:
                await asyncio.sleep(self.delay_s)
                if rid in self.aborted:
                    finish = "abort"
                    break
                tok = next_token(ctx, self.vocab_size)
                out.append(tok)
                ctx.append(tok)
                if self.abort_in_step is not None and self.abort_in_step(rid, len(out)):
                    finish = "abort"
                    break
                if tok == EOS and not sampling_params.get("ignore_eos", False):
                    finish, matched = "stop", tok
                    break
                if tok in stops and not sampling_params.get("ignore_eos", False):
                    finish, matched = "stop", tok
                    break
                text = self.detokenize(out) or ""
                hit = [s for s in stop_strings(sampling_params) if s in text]
                if hit:
                    finish, matched = "stop", hit[0]
                    break
        finally:
            self.active.discard(rid)
        lps = [-0.01 * (t % 7) for t in out]
        return SegmentResult(out, lps, finish, self.version, cached_tokens=0, matched=matched)

    async def generate_on(self, slot: Slot, call: SegmentCall) -> SegmentResult:
        result = await self.generate(call.rid, call.input_ids, call.sampling_params)
        if not call.sampling_mask:
            return result
        ctx, rows, lps = list(call.input_ids), [], []
        for tok in result.output_ids:
            rows.append(kept_set(ctx, tok, self.vocab_size)[::-1])  # SGLang's: any order
            lps.append(kept_logprob(ctx, tok, self.vocab_size))
            ctx.append(tok)
        return replace(result, sampling_mask=mask_rules.encode(rows, lps, "uint16"))

    def abort(self, rid: str) -> None:
        self.aborted.add(rid)


class SnapshotFakeEngine(FakeEngine, SnapshotEngine):
    """Takes a snapshot of a marked request that ends by abort (100 bytes); `info_delay_s`
    makes `snapshot_info` answer late, like a busy scheduler; `lists` lets it list what it
    holds (`snapshot_keys`), as SGLang's engine does. `info_asked` counts the questions."""

    def __init__(self, delay_s: float = 0.002, info_delay_s: float = 0.0, lists: bool = False):
        super().__init__(delay_s=delay_s)
        self.info_delay_s = info_delay_s
        self.lists = lists
        self.info_asked = 0
        self.marks: dict[str, str] = {}
        self.snaps: set[str] = set()

    def send_mark(self, rid: str, key: str, slot: Slot) -> None:
        self.marks[rid] = key

    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        out = await super().generate(rid, input_ids, sampling_params)
        if out.finish_reason == "abort" and rid in self.marks:
            self.snaps.add(self.marks[rid])
        return out

    async def restore_snapshot(self, key: str, slot: Slot, namespace: str | None = None) -> int:
        return 0

    async def release_snapshot(self, key: str, slot: Slot) -> None:
        return None

    async def drop_snapshot(self, key: str, slot: Slot) -> None:
        self.snaps.discard(key)

    async def snapshot_info(self, key: str, slot: Slot) -> dict[str, Any] | None:
        self.info_asked += 1
        await asyncio.sleep(self.info_delay_s)
        return {"tokens": 1, "bytes": 100} if key in self.snaps else None

    async def snapshot_keys(self) -> dict[Slot, dict[str, float]]:
        if not self.lists:
            return {}
        return {slot: {key: 0.0 for key in self.snaps} for slot in self.slots()}

    async def snapshot_stats(self) -> dict[str, Any]:
        return {"snapshot_bytes": 100 * len(self.snaps)}


def segment_runner_over(engine: BaseEngine, allow_stale: bool = False) -> SegmentRunner:
    """A segment runner with its parts, wired as the composition root wires them."""
    counters, admission = Counters(), Admission()
    versions, lengths = WeightVersions(engine), LengthModel()
    running: dict[str, Running] = {}
    places = SnapshotPlaces()
    planner = SegmentPlanner(engine, counters, admission, allow_stale, lengths, places)
    cut = WeightCut(engine, running, versions, planner, places)
    return SegmentRunner(
        engine, counters, admission, versions, lengths, running, planner, cut, places
    )
