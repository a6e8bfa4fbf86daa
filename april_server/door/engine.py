"""The one door to SGLang: every `import sglang` of april-server is in this module.

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
from typing import Any

from april_server.config import AprilConfig
from april_server.engine_base import BaseEngine, SnapshotEngine
from april_server.errors import bad_request
from april_server.inflight import EngineCapacity, StepStat
from april_server.samples import SegmentResult

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


KV_CALL_TIMEOUT_S = 60.0  # a scheduler busy with a long prefill answers between batches


class SGLangEngine(SnapshotEngine):
    """SnapshotEngine over SGLang's TokenizerManager, in the HTTP server's event loop.

    KV control messages (`door/ipc.py`) go down the TokenizerManager's own socket to the
    scheduler, so a `mark` is always ordered before the `abort` sent after it."""

    def __init__(self, tokenizer_manager: Any, snapshots_enabled: bool = True) -> None:
        from sglang.utils import TypeBasedDispatcher

        from april_server.door.ipc import AprilKvResp

        self.tm = tokenizer_manager
        self.context_len = int(tokenizer_manager.context_len)
        self.vocab_size = int(tokenizer_manager.model_config.vocab_size)
        self.snapshots_enabled = snapshots_enabled
        self.assigns_seeds = bool(
            getattr(tokenizer_manager.server_args, "enable_deterministic_inference", False)
        )
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[tuple[bool, dict[str, Any]]]] = {}
        self.tm._result_dispatcher += TypeBasedDispatcher([(AprilKvResp, self._on_kv_resp)])

    def _on_kv_resp(self, resp: Any) -> None:
        fut = self._waiting.pop(resp.call_id, None)
        if fut is not None and not fut.done():
            fut.set_result((bool(resp.ok), json.loads(resp.payload)))

    def _kv_send(self, op: str, key: str = "", target: str = "") -> asyncio.Future[Any]:
        from april_server.door.ipc import AprilKvReq

        call_id = next(self._ids)
        fut: asyncio.Future[tuple[bool, dict[str, Any]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[call_id] = fut
        self.tm._dispatch_to_scheduler(AprilKvReq(call_id=call_id, op=op, key=key, target=target))
        return fut

    async def _kv(self, op: str, key: str = "") -> tuple[bool, dict[str, Any]]:
        fut = self._kv_send(op, key)
        try:
            return await asyncio.wait_for(fut, KV_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.error("april: scheduler did not answer kv %s (is the plugin loaded?)", op)
            return False, {"error": "timeout"}

    def mark_snapshot(self, rid: str, key: str) -> None:
        self._kv_send("mark", key, rid)  # the answer only confirms; nobody waits for it

    async def restore_snapshot(self, key: str) -> int:
        ok, payload = await self._kv("restore", key)
        return int(payload.get("restored", 0)) if ok else 0

    async def release_snapshot(self, key: str) -> None:
        await self._kv("unlock", key)

    async def drop_snapshot(self, key: str) -> None:
        await self._kv("drop", key)

    async def snapshot_info(self, key: str) -> dict[str, Any] | None:
        ok, payload = await self._kv("info", key)
        return payload if ok else None

    async def snapshot_stats(self) -> dict[str, Any]:
        return (await self._kv("stats"))[1]

    async def capacity(self) -> EngineCapacity | None:
        ok, payload = await self._kv("stats")
        if not ok or "max_running_requests" not in payload:
            return None
        return EngineCapacity(
            int(payload["max_running_requests"]), int(payload["max_total_tokens"])
        )

    async def step_curve(self) -> dict[int, StepStat]:
        ok, payload = await self._kv("curve")
        if not ok:
            return {}
        return {int(b): StepStat(int(v[0]), *map(float, v[1:])) for b, v in payload.items()}

    async def engine_clock(self) -> dict[str, float]:
        ok, payload = await self._kv("clock")
        return {k: float(v) for k, v in payload.items()} if ok else {}

    def weight_version(self) -> str:
        return str(self.tm.config_value("weight_version"))

    def tokenize(self, text: str) -> list[int]:
        if self.tm.tokenizer is None:
            raise bad_request("no_tokenizer", "this server has no tokenizer: send input_ids")
        return list(self.tm.tokenizer.encode(text))

    def check_sampling_params(self, params: dict[str, Any]) -> None:
        from sglang.srt.sampling.sampling_params import SamplingParams

        bad = _FORBIDDEN_PARAMS & set(params)
        if bad:
            raise bad_request("invalid_sampling_params", f"not allowed here: {sorted(bad)}")
        try:
            sp = SamplingParams(**params)
            sp.verify(self.vocab_size)
        except (TypeError, ValueError) as exc:
            raise bad_request("invalid_sampling_params", str(exc)) from None

    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            rid=rid,
            input_ids=list(input_ids),
            sampling_params=dict(sampling_params),
            return_logprob=True,
            logprob_start_len=-1,
            stream=False,
        )
        final: dict[str, Any] | None = None
        async for out in self.tm.generate_request(obj, None):
            final = out
        if final is None:
            raise RuntimeError(f"SGLang returned nothing for {rid}")
        meta = final["meta_info"]
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        logprobs = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        return SegmentResult(
            output_ids=list(final.get("output_ids") or []),
            output_logprobs=logprobs,
            finish_reason=kind,
            weight_version=str(meta.get("weight_version", self.weight_version())),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
        )

    def abort(self, rid: str) -> None:
        self.tm.abort_request(rid=rid)

    def engine_stats(self) -> dict[str, Any]:
        return {"context_len": self.context_len, "vocab_size": self.vocab_size}


def launch(sglang_argv: list[str], config: AprilConfig) -> None:
    """Run SGLang's HTTP server with the /april/v1 routes added. Blocks until shutdown."""
    check_sglang_version()
    from sglang.srt.entrypoints import http_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from april_server.app import create_router, extend_app
    from april_server.auth import AuthPolicy
    from april_server.server import ManagerHolder

    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    server_args.resolve_once()
    if getattr(server_args, "tokenizer_worker_num", 1) != 1:
        raise SystemExit("april-server needs --tokenizer-worker-num 1 (one rollout manager)")

    def make_engine() -> BaseEngine:
        tm = http_server.get_global_state().tokenizer_manager
        return SGLangEngine(tm, snapshots_enabled=config.kv_host_bytes > 0)

    holder = ManagerHolder(config, make_engine)
    auth = AuthPolicy(server_args.api_key, getattr(server_args, "admin_api_key", None))
    http_server.app.include_router(create_router(holder.get, config, auth))
    extend_app(http_server.app)
    http_server.launch_server(server_args)
