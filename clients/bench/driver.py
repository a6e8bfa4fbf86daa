"""The RL-loop driver: S steps, each consuming K whole groups of n samples, in one mode.

- `sync`: the K groups' K x n members go to SGLang's native `/generate` concurrently and the
  trainer waits for all of them (a trainer without APRIL).
- `april`: each step sends new groups so that buffered + new = over_sampling x K, asks
  `/april/v1/rollouts` for K finished groups (`on_quota: tokens`, so resumes re-prefill).
- `april-kv`: the same with `on_quota: snapshot` (resumes restore KV snapshots); refused, not
  faked, when the server has no KV snapshots.
Between steps: optional simulated training (`train_time`) and a weight-version bump.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx

from .accounting import Consumed, Ledger
from .metrics import ModeResult, StepRecord, timeline_stats
from .server_api import (
    BenchError,
    LoadPoller,
    R,
    ServerInfo,
    buffered_groups,
    check,
    delete_groups,
    engine_clock,
)
from .workload import WorkGroup, Workload

Mode = Literal["sync", "april", "april-kv"]
MODES: tuple[Mode, ...] = ("sync", "april", "april-kv")


@dataclass(frozen=True)
class ModeSpec:
    """One column of the comparison: a mode, and for APRIL modes its `max_inflight_groups`
    policy. Written `april@auto`, `april@all`, `april-kv@16`; plain `april` takes the run's
    `--max-inflight`. The label names the column and the mode's group ids."""

    kind: Mode
    max_inflight: str  # "all" (static APRIL), "auto" or a positive integer
    label: str

    @classmethod
    def parse(cls, text: str, default_inflight: str = "all") -> ModeSpec:
        kind, sep, policy = text.strip().partition("@")
        if kind not in MODES:
            raise BenchError(f"unknown mode {kind!r}; choose from {', '.join(MODES)}")
        if sep and kind == "sync":
            raise BenchError("sync takes no @policy: it sends every group at once by definition")
        policy = policy if sep else default_inflight
        if policy not in ("all", "auto") and not (policy.isdigit() and int(policy) > 0):
            raise BenchError(f"{text!r}: the policy after @ must be all, auto or an integer > 0")
        return cls(kind, policy, text.strip())

    @property
    def slug(self) -> str:
        return self.label.replace("@", "-at-")


class Progress(Protocol):
    def update(self, n: int = 1) -> object: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> object: ...


@dataclass
class BenchConfig:
    steps: int = 4
    groups: int = 8
    n: int = 4
    over_sampling: float = 2.0
    max_tokens: int = 512
    temperature: float = 1.0
    train_time: float = 0.0
    bump_version: bool = False
    max_inflight: str = "all"  # "all" (static APRIL), "auto" or an integer
    max_staleness: int | None = None
    stream_sync: bool = False
    poll_hz: float = 20.0
    run_tag: str = "bench"
    keep_buffer: bool = False
    interleave: bool = False  # step s of every mode, then step s+1 (one APRIL mode at most)


@dataclass
class StepOutcome:
    record: StepRecord
    consumed: list[Consumed] = field(default_factory=list)


class ModeRunner:
    def __init__(
        self,
        http: httpx.AsyncClient,
        spec: ModeSpec | Mode,
        cfg: BenchConfig,
        workload: Workload,
        info: ServerInfo,
        progress: Progress | None = None,
    ) -> None:
        if isinstance(spec, str):
            spec = ModeSpec.parse(spec, cfg.max_inflight)
        self.spec, self.mode, self.label = spec, spec.kind, spec.label
        self.http, self.cfg, self.wl, self.info = http, cfg, workload, info
        self.progress = progress
        self.result = ModeResult(mode=spec.label)
        exact = workload.kind != "natural"
        self.ledger = Ledger(spec.label, cfg.groups, cfg.n, exact_budgets=exact)
        self.next_index = 0
        self.version = info.weight_version
        self.buffered: list[str] = []
        self.windows: list[tuple[float, float, float]] = []  # (session start, end, local start)
        self.ticks = 0
        self.finished = False

    def gid(self, g: WorkGroup) -> str:
        return f"{self.cfg.run_tag}-{self.spec.slug}-g{g.index:06d}"

    def draw(self, count: int) -> list[WorkGroup]:
        groups = self.wl.groups(self.next_index, count)
        self.next_index += count
        for g in groups:
            self.ledger.send(self.gid(g), g.index, g.budgets)
        return groups

    def prompt(self, g: WorkGroup) -> dict[str, Any]:
        return {"input_ids": list(g.input_ids)} if g.input_ids is not None else {"text": g.text}

    def tick(self, step: int) -> None:
        self.ticks += 1
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(f"{self.label} step {step + 1}/{self.cfg.steps}")

    def check_available(self) -> bool:
        if self.mode == "april-kv" and not self.info.kv_snapshots:
            self.result.available = False
            self.result.reason = f"no KV snapshots on this server: {self.info.kv_reason}"
        return self.result.available

    async def step(self, step: int, poller: LoadPoller) -> None:
        """Run one step and record it; `poller` times are seconds since the session began."""
        clock0 = await engine_clock(self.http)
        a0 = time.perf_counter() - poller.t0
        out = await (self.sync_step(step) if self.mode == "sync" else self.april_step(step))
        if not self.result.available:
            return
        rec = out.record
        if clock0:
            clock = {k: v - clock0.get(k, 0.0) for k, v in (await engine_clock(self.http)).items()}
            rec.prefill_s, rec.decode_s = clock.get("prefill_s"), clock.get("decode_s")
            rec.prefill_tokens = int(clock.get("prefill_tokens", 0))
            rec.decode_steps = int(clock.get("decode_batches", 0))
            rec.decode_tokens = int(clock.get("decode_tokens", 0))
            rec.decode_context_tokens = int(clock.get("decode_context_tokens", 0))
        local = self.result.steps[-1].t_end if self.result.steps else 0.0
        rec.t_start, rec.t_end = local, local + rec.wall_s
        self.windows.append((a0, a0 + rec.wall_s, local))
        rec.mean_running, rec.idle_frac, rec.tail_frac = timeline_stats(
            poller.samples, a0, a0 + rec.wall_s, self.cfg.groups * self.cfg.n
        )
        rec.max_budget = max((c.tokens for c in out.consumed), default=0)
        self.ledger.consume(step, out.consumed)
        self.result.steps.append(rec)

    async def finish(self, poller: LoadPoller) -> ModeResult:
        """Mode-local timeline (this mode's rollout phases only, end to end), leftover, checks.
        Idempotent; must run before another APRIL mode starts (it frees this mode's buffer)."""
        if self.finished:
            return self.result
        self.finished = True
        self.result.timeline = [
            (local + t - a0, r) for a0, a1, local in self.windows for t, r in poller.samples
            if a0 <= t <= a1
        ]  # fmt: skip
        await self.collect_leftover()
        # A mode found unavailable mid-step did not record what it received: nothing to check.
        self.result.checks = self.ledger.check() if self.result.available else []
        return self.result

    # ---- sync ---------------------------------------------------------------------------------

    async def sync_step(self, step: int) -> StepOutcome:
        groups = self.draw(self.cfg.groups)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(self.sync_group(g, t0, step) for g in groups))
        wall = time.perf_counter() - t0
        consumed = [c for group in outs for c, _ in group]
        off = sum(c.tokens for group in outs for c, v in group if v != self.version)
        tokens = sum(c.tokens for c in consumed)
        rec = StepRecord(step, wall, wall, len(consumed), tokens, tokens, offpolicy_tokens=off,
                         weight_version=self.version)  # fmt: skip
        return StepOutcome(rec, consumed)

    async def sync_group(self, g: WorkGroup, t0: float, step: int) -> list[tuple[Consumed, str]]:
        members = await asyncio.gather(*(self.generate(g, j) for j in range(g.n)))
        self.result.group_latencies.append(time.perf_counter() - t0)
        self.tick(step)
        return members

    async def generate(self, g: WorkGroup, j: int) -> tuple[Consumed, str]:
        params = g.sampling_params(self.cfg.max_tokens, self.cfg.temperature)
        params["max_new_tokens"] = g.budgets[j] if g.ignore_eos else self.cfg.max_tokens
        body = {**self.prompt(g), "sampling_params": params, "return_logprob": True,
                "stream": self.cfg.stream_sync}  # fmt: skip
        start = time.perf_counter()
        chunks: list[float] = []
        if self.cfg.stream_sync:
            final, chunks = await self.stream_generate(body)
        else:
            final = check(await self.http.post("/generate", json=body), "POST /generate")
            self.result.latencies.add_e2e(time.perf_counter() - start)
        meta = final["meta_info"]
        tokens = int(meta.get("completion_tokens", len(final.get("output_ids") or [])))
        if chunks:
            self.result.latencies.add_request(start, chunks, tokens)
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else reason
        status = {"length": "truncated", "stop": "completed"}.get(str(kind), str(kind))
        gid = self.gid(g)
        return Consumed(f"{gid}/{j}", gid, j, tokens, status), str(meta.get("weight_version"))

    async def stream_generate(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
        final: dict[str, Any] = {}
        chunks: list[float] = []
        async with self.http.stream("POST", "/generate", json=body) as resp:
            if resp.status_code >= 400:
                raise BenchError(f"POST /generate: HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunks.append(time.perf_counter())
                final = json.loads(line[5:])
        return final, chunks

    # ---- april / april-kv ---------------------------------------------------------------------

    def inflight(self, total: int) -> int | str:
        m = self.spec.max_inflight
        return total if m == "all" else m if m == "auto" else int(m)

    async def april_step(self, step: int) -> StepOutcome:
        cfg = self.cfg
        want = max(cfg.groups, math.ceil(cfg.over_sampling * cfg.groups))
        groups = self.draw(max(0, want - len(self.buffered)))
        body = {
            "groups": [
                {"group_id": self.gid(g), **self.prompt(g), "n": g.n,
                 "sampling_params": g.sampling_params(cfg.max_tokens, cfg.temperature),
                 "member_params": g.member_params(), "metadata": {"answer": g.answer}}
                for g in groups
            ],
            "target_groups": cfg.groups,
            "resume_first": True,
            "on_quota": "snapshot" if self.mode == "april-kv" else "tokens",
            "max_staleness": cfg.max_staleness,
            "max_inflight_groups": self.inflight(len(self.buffered) + len(groups)),
            "stream": True,
            "request_id": f"{cfg.run_tag}-{self.spec.slug}-s{step}",
        }  # fmt: skip
        t0 = time.perf_counter()
        finished: list[dict[str, Any]] = []
        ttq: float | None = None
        stats: dict[str, Any] = {}
        buffered: list[str] = []
        async with self.http.stream("POST", R + "/rollouts", json=body) as resp:
            if resp.status_code >= 400:
                raise BenchError(f"POST rollouts: HTTP {resp.status_code}: {await resp.aread()!r}")
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                ev = json.loads(line)
                if ev["event"] == "group_finished":
                    finished.append(ev["group"])
                    self.result.group_latencies.append(time.perf_counter() - t0)
                    if len(finished) == cfg.groups:
                        ttq = time.perf_counter() - t0
                    self.tick(step)
                elif ev["event"] == "done":
                    stats, buffered = ev["stats"], ev["buffered_group_ids"]
        wall = time.perf_counter() - t0
        self.buffered = buffered
        if self.mode == "april-kv" and stats.get("on_quota_effective") != "snapshot":
            self.result.available = False
            self.result.reason = (
                f"the server ran on_quota=snapshot as {stats.get('on_quota_effective')!r}: "
                "no KV snapshots in this build"
            )
        version = str(stats.get("weight_version", self.version))
        consumed, off = [], 0
        for grp in finished:
            for s in grp["samples"]:
                n_tok = len(s["output_ids"])
                consumed.append(Consumed(s["sample_id"], grp["group_id"], s["index"], n_tok,
                                         s["status"]))  # fmt: skip
                off += sum(seg["end"] - seg["start"] for seg in s["segments"]
                           if seg["weight_version"] != version)  # fmt: skip
        rec = StepRecord(
            step, wall, ttq if ttq is not None else float(stats.get("time_to_quota_s") or wall),
            len(consumed), sum(c.tokens for c in consumed), int(stats.get("output_tokens", 0)),
            offpolicy_tokens=off,
            restored_kv_tokens=int(stats.get("restored_kv_tokens", 0)),
            recomputed_tokens=int(stats.get("recomputed_tokens", 0)),
            resumed_samples=int(stats.get("resumed_samples", 0)),
            buffered_groups=len(buffered), weight_version=version,
            inflight_target=stats.get("inflight_target"),
        )  # fmt: skip
        return StepOutcome(rec, consumed)

    async def collect_leftover(self) -> None:
        """Report (not lose) what is still buffered, then free it unless asked to keep it."""
        if self.mode == "sync":
            return
        prefix = f"{self.cfg.run_tag}-{self.spec.slug}-g"
        ours = [g for g in await buffered_groups(self.http) if g["group_id"].startswith(prefix)]
        tokens = {g["group_id"]: sum(len(s["output_ids"]) for s in g["samples"]) for g in ours}
        self.ledger.set_leftover(tokens)
        self.result.leftover_groups = len(ours)
        self.result.leftover_tokens = sum(tokens.values())
        if not self.cfg.keep_buffer:
            await delete_groups(self.http, list(tokens))
