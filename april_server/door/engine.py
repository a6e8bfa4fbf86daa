"""The HTTP-process side of the door to SGLang (`door/` as a whole is the only package that
imports `sglang`: tests/unit/project/test_structure.py; the scheduler-process side is
`scheduler_hooks.py`).

- `SGLangEngine` drives the in-process TokenizerManager (`generate_request`, `abort_request`).
- `launch()` builds SGLang's own server args and FastAPI app, adds our routes, and runs
  SGLang's `launch_server` unchanged, so every SGLang flag and native route keeps working.
Version-checked: names move between SGLang releases, so anything but the pin is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from april_client.protocol import RoutingDtype, WeightGroupInfo
from april_server.door.channel import (
    Clock,
    Curve,
    Drop,
    Info,
    Keys,
    Mark,
    Reply,
    Restore,
    SchedulerOp,
    Stats,
    Unlock,
    encode,
    op_name,
)
from april_server.engine.base import BaseEngine, SegmentCall, SnapshotEngine
from april_server.engine.weight_session import WeightSession
from april_server.rules import sampling_mask as mask_rules
from april_server.rules.inflight import EngineCapacity, StepStat, aggregate_curve
from april_server.rules.placement import LOCAL, Slot
from april_server.rules.ranks import merge_rank_stats
from april_server.rules.routing_replay import RoutingRows, dtype_for
from april_server.rules.samples import SegmentResult
from april_server.settings.config import AprilConfig
from april_server.wire.auth import AuthPolicy
from april_server.wire.errors import bad_request

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
# Sampling params a rollout may carry; `n` is the group's and beams don't fit partial resume.
_FORBIDDEN_PARAMS = {"n", "beam_width", "stream_interval"}


def check_sglang_version() -> None:
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"april-server {SGLANG_VERSION=} is pinned, but sglang {sglang.__version__} is "
            "installed: its internals differ. Install sglang==" + SGLANG_VERSION
        )


def check_sampling_params(params: dict[str, Any], vocab_size: int | None) -> None:
    """Raise ApiError(400) for sampling params SGLang would reject (an owner of remote
    engines checks them here too, before anything is sent)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    bad = _FORBIDDEN_PARAMS & set(params)
    if bad:
        raise bad_request("invalid_sampling_params", f"not allowed here: {sorted(bad)}")
    try:
        sp = SamplingParams(**params)
        sp.verify(vocab_size)
        _check_stop_counts(sp)
    except (TypeError, ValueError) as exc:
        raise bad_request("invalid_sampling_params", str(exc)) from None


def _check_stop_counts(sp: Any) -> None:
    """The stop lists' bounds, which SGLang checks only when its tokenizer manager normalizes
    a request (`SamplingParams.normalize`; called here without a tokenizer, it would also
    refuse every stop string, as if the server had none)."""
    from sglang.srt.sampling import sampling_params as sglang_sp

    for kind, given, most in (
        ("stop strings", sp.stop_strs, sglang_sp.MAX_STOP_COUNT),
        ("stop_regex patterns", sp.stop_regex_strs, sglang_sp.MAX_STOP_REGEX_COUNT),
    ):
        n = 1 if isinstance(given, str) else len(given or [])
        if n > most:
            raise ValueError(f"at most {most} {kind} are allowed, got {n}")


def preload_sampling_params() -> None:
    """Import what `check_sampling_params` needs (seconds, once), e.g. off the event loop."""
    import sglang.srt.sampling.sampling_params  # noqa: F401


KV_CALL_TIMEOUT_S = 60.0  # a scheduler busy with a long prefill answers between batches
ALL_RANKS = -1


@dataclass
class _Gather:
    """Answers to one KV message: one from the addressed rank, or one from every rank."""

    call_id: int
    expect: int
    done: asyncio.Future[None]
    replies: dict[int, Reply] = field(default_factory=dict)


class SGLangEngine(SnapshotEngine):
    """SnapshotEngine over SGLang's TokenizerManager, in the HTTP server's event loop.

    KV control messages (one struct per operation, `door/channel.py`, in the envelope of
    `door/ipc.py`) go down the TokenizerManager's own socket to the scheduler, so a `mark` is
    always ordered before the `abort` sent after it. With `--dp-size N` every segment is pinned
    to its rank (`GenerateReqInput.routed_dp_rank`), each KV message names the rank that acts,
    and the figures come from all N."""

    def __init__(
        self,
        tokenizer_manager: Any,
        weights: WeightSession,
        snapshots_enabled: bool = True,
        dp_size: int = 1,
    ) -> None:
        """`weights`: the process's weight session (the group this server joined)."""
        from sglang.utils import TypeBasedDispatcher

        from april_server.door.ipc import AprilKvResp

        self.tm = tokenizer_manager
        self.weights = weights
        self.context_len = int(tokenizer_manager.context_len)
        self.vocab_size = int(tokenizer_manager.model_config.vocab_size)
        self.snapshots_enabled = snapshots_enabled
        self.dp_size = max(1, dp_size)
        self.assigns_seeds = bool(
            getattr(tokenizer_manager.server_args, "enable_deterministic_inference", False)
        )
        self.eos_token_ids = _eos_ids(tokenizer_manager)
        self.routing_format = routing_format(tokenizer_manager)
        self.sampling_mask_tokens = (
            int(getattr(tokenizer_manager.server_args, "sampling_mask_max_tokens", 0) or 0) or None
        )
        self._ids = itertools.count()
        self._waiting: dict[int, _Gather] = {}
        self.tm._result_dispatcher += TypeBasedDispatcher([(AprilKvResp, self._on_kv_resp)])

    def slots(self) -> list[Slot]:
        return [Slot(LOCAL, r) for r in range(self.dp_size)]

    # ---- KV control messages -------------------------------------------------------------

    def _on_kv_resp(self, resp: Any) -> None:
        g = self._waiting.get(resp.call_id)
        if g is None:
            return  # a late answer to a call that timed out
        g.replies[int(resp.dp_rank)] = (bool(resp.ok), json.loads(resp.payload))
        if len(g.replies) >= g.expect:
            del self._waiting[resp.call_id]
            if not g.done.done():
                g.done.set_result(None)

    def _kv_send(self, op: SchedulerOp, dp_rank: int) -> _Gather:
        from april_server.door.ipc import AprilKvReq

        call_id = next(self._ids)
        expect = self.dp_size if dp_rank == ALL_RANKS else 1
        g = _Gather(call_id, expect, asyncio.get_running_loop().create_future())
        self._waiting[call_id] = g
        req = AprilKvReq(call_id=call_id, body=encode(op), dp_rank=dp_rank)
        self.tm._dispatch_to_scheduler(req)
        return g

    async def _gather(self, op: SchedulerOp, dp_rank: int = ALL_RANKS) -> dict[int, Reply]:
        g = self._kv_send(op, dp_rank)
        try:
            await asyncio.wait_for(asyncio.shield(g.done), KV_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._waiting.pop(g.call_id, None)
            logger.error(
                "april: kv %s: %d of %d ranks answered (is the plugin loaded?)",
                op_name(op),
                len(g.replies),
                g.expect,
            )
        return g.replies

    async def _kv(self, op: SchedulerOp, slot: Slot) -> Reply:
        replies = await self._gather(op, slot.dp_rank)
        return replies.get(slot.dp_rank, (False, {"error": "timeout"}))

    async def _per_rank(self, op: SchedulerOp) -> dict[int, dict[str, Any]]:
        """Every rank's answer to `op`, by rank in rank order (ranks that failed are left out)."""
        replies = await self._gather(op)
        return {r: p for r, (ok, p) in sorted(replies.items()) if ok}

    def send_mark(self, rid: str, key: str, slot: Slot) -> None:
        # The answer only confirms; nobody waits for it.
        self._kv_send(Mark(rid=rid, key=key), slot.dp_rank)

    async def restore_snapshot(self, key: str, slot: Slot, namespace: str | None = None) -> int:
        ok, payload = await self._kv(Restore(key=key, namespace=namespace or ""), slot)
        return int(payload.get("restored", 0)) if ok else 0

    async def release_snapshot(self, key: str, slot: Slot) -> None:
        await self._kv(Unlock(key=key), slot)

    async def drop_snapshot(self, key: str, slot: Slot) -> None:
        await self._kv(Drop(key=key), slot)

    async def snapshot_info(self, key: str, slot: Slot) -> dict[str, Any] | None:
        ok, payload = await self._kv(Info(key=key), slot)
        return payload if ok else None

    async def snapshot_keys(self) -> dict[Slot, dict[str, float]]:
        return {
            Slot(LOCAL, r): p.get("keys", {}) for r, p in (await self._per_rank(Keys())).items()
        }

    async def snapshot_stats(self) -> dict[str, Any]:
        ranks = await self._per_rank(Stats())
        merged = merge_rank_stats(list(ranks.values()))
        if self.dp_size > 1:
            merged["dp_size"] = self.dp_size
            merged["dp_ranks"] = [{"dp_rank": r, **p} for r, p in ranks.items()]
        return merged

    async def capacity(self) -> EngineCapacity | None:
        ranks = [p for p in (await self._per_rank(Stats())).values() if "max_running_requests" in p]
        if not ranks:
            return None
        return EngineCapacity(  # the whole server's: the sum over its ranks
            sum(int(r["max_running_requests"]) for r in ranks),
            sum(int(r["max_total_tokens"]) for r in ranks),
        )

    async def step_curve(self) -> dict[int, StepStat]:
        curves = [
            {int(b): StepStat(int(v[0]), *map(float, v[1:])) for b, v in p.items()}
            for p in (await self._per_rank(Curve())).values()
        ]
        return aggregate_curve(curves)  # ranks step side by side: inflight.py

    async def engine_clock(self) -> dict[str, float]:
        ranks = await self._per_rank(Clock())
        return {k: float(v) for k, v in merge_rank_stats(list(ranks.values())).items()}

    def weight_version(self) -> str:
        return str(self.tm.config_value("weight_version"))

    def weight_group(self) -> WeightGroupInfo:
        group = self.weights.group
        return WeightGroupInfo(
            ranks=int(getattr(self.tm.server_args, "tp_size", 1) or 1),
            weight_version=self.weight_version(),
            group=None if group is None else group.name,
            world_size=None if group is None else group.world_size,
            in_sync=group is not None,
        )

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        if self.tm.tokenizer is None:
            raise bad_request("no_tokenizer", "this server has no tokenizer: send input_ids")
        return list(self.tm.tokenizer.encode(text, add_special_tokens=special))

    def detokenize(self, ids: list[int]) -> str | None:
        if self.tm.tokenizer is None:
            return None
        return str(self.tm.tokenizer.decode(ids))

    def check_sampling_params(self, params: dict[str, Any]) -> None:
        check_sampling_params(params, self.vocab_size)

    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        return await self._generate(rid, input_ids, sampling_params, None)

    async def generate_on(self, slot: Slot, call: SegmentCall) -> SegmentResult:
        rank = slot.dp_rank if self.dp_size > 1 else None
        return await self._generate(
            call.rid,
            call.input_ids,
            call.sampling_params,
            rank,
            call.cache_ns,
            call.routing_start,
            call.sampling_mask,
        )

    async def _generate(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rank: int | None,
        extra_key: str | None = None,
        routing_start: int | None = None,
        sampling_mask: bool = False,
    ) -> SegmentResult:
        from sglang.srt.managers.io_struct import GenerateReqInput

        asked = routing_start if self.routing_format is not None else None
        extra: dict[str, Any] = {}
        if asked is not None:
            extra = {"return_routed_experts": True, "routed_experts_start_len": asked}
        mask = sampling_mask and self.sampling_mask_tokens is not None
        if mask:
            extra["return_sampling_mask"] = True
        obj = GenerateReqInput(
            rid=rid,
            input_ids=list(input_ids),
            sampling_params=dict(sampling_params),
            return_logprob=True,
            logprob_start_len=-1,
            stream=False,
            routed_dp_rank=rank,  # SGLang's DP controller sends it to that rank, unbalanced
            extra_key=extra_key,  # a stale restore's own prefix-cache namespace
            **extra,
        )
        final: dict[str, Any] | None = None
        async for out in self.tm.generate_request(obj, None):
            final = out
        if final is None:
            raise RuntimeError(f"SGLang returned nothing for {rid}")
        meta = final["meta_info"]
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        matched = reason.get("matched") if isinstance(reason, dict) else None
        if isinstance(matched, list):  # a multi-token stop: its last token ended it
            matched = matched[-1] if matched else None
        logprobs = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        output_ids = list(final.get("output_ids") or [])
        return SegmentResult(
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_reason=kind,
            weight_version=str(meta.get("weight_version", self.weight_version())),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            dp_rank=None if meta.get("dp_rank") is None else int(meta["dp_rank"]),
            matched=matched if isinstance(matched, (str, int)) else None,
            routing_asked=asked,
            routing=None if asked is None else self._rows(asked, meta.get("routed_experts")),
            sampling_mask=self._mask_rows(meta, len(output_ids)) if mask else None,
        )

    def _mask_rows(self, meta: dict[str, Any], num_tokens: int) -> mask_rules.MaskRows | None:
        """SGLang's per-token kept ids (`output_token_sampling_mask`, in its order) and
        sampling logprobs, one row per output token, in our stored form (None: none came)."""
        rows = meta.get("output_token_sampling_mask")
        if rows is None:
            return None if num_tokens else mask_rules.encode([], [], "uint16")
        rows = rows[:num_tokens]
        logprobs = (meta.get("output_token_sampling_logprobs") or [])[:num_tokens]
        dtype = mask_rules.dtype_for(self.vocab_size, self.sampling_mask_tokens or 0)
        return mask_rules.encode(rows, logprobs, dtype)

    def _rows(self, start: int, encoded: Any) -> RoutingRows | None:
        """SGLang's base64 int32 `[rows, layers, top_k]` as our compact rows (None: absent)."""
        if not isinstance(encoded, str) or self.routing_format is None:
            return None
        layers, top_k, dtype = self.routing_format
        return RoutingRows(start, compact_rows(encoded, dtype), layers, top_k, dtype)

    def abort(self, rid: str) -> None:
        self.tm.abort_request(rid=rid)

    def engine_stats(self) -> dict[str, Any]:
        return {
            "context_len": self.context_len,
            "vocab_size": self.vocab_size,
            "model_path": str(self.tm.server_args.model_path),
            "has_tokenizer": self.tm.tokenizer is not None,
        }


def routing_format(tm: Any) -> tuple[int, int, RoutingDtype] | None:
    """(layers, top_k, dtype) of the routed experts SGLang captures (`--enable-return-routed-
    experts` on a MoE model: one row per token per layer, as its capturer sizes them); None
    when it captures none."""
    if not getattr(tm.server_args, "enable_return_routed_experts", False):
        return None
    text = tm.model_config.hf_text_config
    top_k = getattr(text, "num_experts_per_tok", None)
    if not top_k:
        return None
    experts = next(
        (
            int(v)
            for k in ("num_local_experts", "num_experts", "n_routed_experts")
            if (v := getattr(text, k, None))
        ),
        0x7FFF,
    )
    return int(text.num_hidden_layers), int(top_k), dtype_for(experts)


def compact_rows(encoded: str, dtype: RoutingDtype) -> bytes:
    """SGLang's routed experts (base64 of int32) in `dtype`, little-endian."""
    import numpy as np
    import pybase64

    ids = np.frombuffer(pybase64.b64decode(encoded), dtype=np.int32)
    return ids.astype("<u1" if dtype == "uint8" else "<i2").tobytes()


def _eos_ids(tm: Any) -> frozenset[int]:
    """The ids SGLang's scheduler stops at unless `ignore_eos` (`Req.eos_token_ids` and the
    tokenizer's EOS)."""
    ids = set(getattr(tm.model_config, "hf_eos_token_id", None) or ())
    eos = getattr(tm.tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return frozenset(ids)


# What the layers above add to SGLang's app: given the app, a factory for the engine (called
# once SGLang's server runs) and the auth policy, mount the /april/v1 routes. The door takes it as
# an argument so that it imports nothing from the layers above it
# (tests/unit/project/test_layers.py).
MountRoutes = Callable[[Any, Callable[[], BaseEngine], AuthPolicy], None]


def launch(
    sglang_argv: list[str], config: AprilConfig, weights: WeightSession, mount: MountRoutes
) -> None:
    """Run SGLang's HTTP server with the routes that `mount` adds; SGLang's weight routes go
    through `weights` (the process's weight session). Blocks until shutdown."""
    check_sglang_version()
    from sglang.srt.entrypoints import http_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from april_server.door.preload import register_preload_hooks
    from april_server.door.weight_hooks import WeightHooks

    WeightHooks(weights).register()  # this process only: it serves the weight-update routes
    register_preload_hooks()  # ... and starts SGLang's children (from the fork server, if any)
    load_plugins()  # ... and applies every registered hook
    server_args = prepare_server_args(sglang_argv)
    server_args.resolve_once()
    if getattr(server_args, "tokenizer_worker_num", 1) != 1:
        raise SystemExit("april-server needs --tokenizer-worker-num 1 (one rollout manager)")
    if int(getattr(server_args, "attn_dp_size", 1) or 1) > 1:
        # Its control messages reach only the DP group leaders, not a chosen replica.
        raise SystemExit("april-server supports --dp-size (replicas), not DP attention")
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)

    def make_engine() -> BaseEngine:
        tm = http_server.get_global_state().tokenizer_manager
        return SGLangEngine(
            tm, weights, snapshots_enabled=config.kv_host_bytes > 0, dp_size=dp_size
        )

    auth = AuthPolicy(server_args.api_key, getattr(server_args, "admin_api_key", None))
    mount(http_server.app, make_engine, auth)
    http_server.launch_server(server_args)
