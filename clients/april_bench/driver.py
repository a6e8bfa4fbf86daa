"""The RL-loop driver: S steps, each consuming K whole groups of n samples, in one mode.

- `sync`: the K groups' K x n members go to SGLang's native `/generate` concurrently and the
  trainer waits for all of them (a trainer without APRIL).
- `april`: each step sends new groups so that buffered + new = over_sampling x K, asks
  `/april/v1/rollouts` for K finished groups (`on_quota: tokens`, so resumes re-prefill).
- `april-kv`: the same with `on_quota: snapshot` (resumes restore KV snapshots); refused, not
  faked, when the server has no KV snapshots.
- `april-tail`: `april` with `length_order: longest_first` (the server starts a call's new
  groups by predicted length, longest first: docs/api.md, Length prediction), holding as
  many groups as the last call's `stats.groups_wanted` advised (never fewer than
  over_sampling x K): the server sizes the over-provisioning from its predicted lengths.
- `april-async`: over-provisioning like `april`, with `on_quota: continue` (the call's
  stragglers keep generating in the background after it answered) and prefetch: right after a
  call answers, the next step's new groups go in with `POST /groups` (`start: background`), so
  they generate while the trainer trains and the next call sends no groups.
Between steps: optional simulated training (`train_time`) and a weight push (`bump_version`),
whose latency is measured against one push with nothing running at the start.
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
from .gap import decode_buckets
from .length_stats import length_figures, score_delta
from .metrics import ModeResult, StepRecord, timeline_stats, windows_idle_frac
from .server_api import (
    BenchError,
    LoadPoller,
    R,
    ServerInfo,
    abort_groups,
    background_tokens,
    buffered_groups,
    check,
    delete_groups,
    engine_clock,
    rollout_events,
)
from .staleness import add, offpolicy_tokens, sample_histogram, version_lag
from .workload import WorkGroup, Workload

Mode = Literal["sync", "april", "april-kv", "april-async", "april-tail"]
MODES: tuple[Mode, ...] = ("sync", "april", "april-kv", "april-async", "april-tail")
DEFAULT_MODES: tuple[Mode, ...] = ("sync", "april", "april-kv", "april-async")
ON_QUOTA = {"april": "tokens", "april-kv": "snapshot", "april-async": "continue",
            "april-tail": "tokens"}  # fmt: skip
# Tail-aware APRIL: `april` whose calls start their new groups predicted-longest first.
LENGTH_ORDER = {"april-tail": "longest_first"}


@dataclass(frozen=True)
class ModeSpec:
    """One column of the comparison: a mode, and for APRIL modes its `max_inflight_groups`
    policy. Written `april@auto`, `april@all`, `april-kv@16`, `april-async@auto`; plain
    `april` takes the run's `--max-inflight`. The label names the column and the mode's
    group ids."""

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
    # --train-s auto: train as long as sync's rollout took (each sync step its own; the other
    # modes sync's mean): T = R, where overlapping training with rollout gains the most,
    # measured in the same run rather than guessed.
    train_auto: bool = False
    bump_version: bool = False
    step_versions: bool = False  # name pushed versions by step number ("0", "1", ...): --train-s
    max_inflight: str = "all"  # "all" (static APRIL), "auto" or an integer
    max_staleness: int | None = None
    stream_sync: bool = False
    poll_hz: float = 20.0
    run_tag: str = "bench"
    keep_buffer: bool = False
    interleave: bool = False  # step s of every mode, then step s+1 (one APRIL mode at most)
    # Every APRIL mode under "auto" holds what the server advised (`stats.groups_wanted`), as
    # april-tail always does: the pool the server sized for goodput.
    size_pool: bool = False


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
        exact = workload.kind not in ("natural", "text")
        self.ledger = Ledger(spec.label, cfg.groups, cfg.n, exact_budgets=exact)
        self.next_index = 0
        self.version = info.weight_version
        self.history = [info.weight_version]  # versions in push order: staleness counts in it
        self.buffered: list[str] = []
        self.windows: list[tuple[float, float, float]] = []  # (session start, end, local start)
        self.run_windows: list[tuple[float, float]] = []  # rollouts, prefetch, training, push
        self.background0 = 0
        self.ticks = 0
        self.finished = False
        self.pred0: dict[str, Any] | None = None
        self.advised = 0  # april-tail: the last call's stats.groups_wanted

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
        if self.mode == "april-async" and not self.info.background:
            self.result.available = False
            self.result.reason = "no background generation on this server (/stats has no "
            self.result.reason += "background_groups: on_quota continue and POST /groups)"
        return self.result.available

    def set_version(self, version: str) -> None:
        self.version = version
        if self.history[-1] != version:
            self.history.append(version)

    async def begin(self) -> None:
        """Before the mode's first step: where the server's background tally and its length
        prediction score stand."""
        if self.mode != "sync":
            self.pred0 = await self.prediction_score()
        if self.mode == "april-async":
            self.background0 = await background_tokens(self.http)

    def trained(self, train_s: float, push_s: float | None, t0: float, t1: float) -> None:
        """The trainer's time after the last step: the training wait, then the push (if any);
        `t0`, `t1` in seconds since the session began."""
        rec = self.result.steps[-1]
        rec.train_s, rec.push_s = train_s, push_s
        self.run_windows.append((t0, t1))

    @property
    def want(self) -> int:
        """Groups in flight at each call: over-sampling x K (at least K); april-tail: more if
        the server advised more; with `size_pool`, an "auto" mode: what it advised."""
        base = max(self.cfg.groups, math.ceil(self.cfg.over_sampling * self.cfg.groups))
        if self.cfg.size_pool and self.spec.max_inflight == "auto" and self.advised:
            # Exactly the advice: a group held beyond it would wait idle in a call, but
            # april-async's prefetch would start it in the background, past the pool.
            return max(self.cfg.groups, self.advised)
        return max(base, self.advised) if self.mode == "april-tail" else base

    def outstanding(self) -> int:
        """Our groups on the server (buffered, generating or finished, not yet consumed).
        april-async counts them from its ledger: a call lists only the groups it claimed,
        not the background ones it did not need."""
        if self.mode == "april-async":
            return len(self.ledger.outstanding())
        return len(self.buffered)

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
            rec.prefill_requests = int(clock.get("prefill_requests", 0))
            rec.engine_idle_s = clock.get("idle_s")
            rec.decode_by_bucket = decode_buckets(clock)
        local = self.result.steps[-1].t_end if self.result.steps else 0.0
        rec.t_start, rec.t_end = local, local + rec.wall_s
        self.windows.append((a0, a0 + rec.wall_s, local))
        self.run_windows.append((a0, a0 + rec.wall_s))
        rec.mean_running, rec.idle_frac, rec.tail_frac = timeline_stats(
            poller.samples, a0, a0 + rec.wall_s, self.cfg.groups * self.cfg.n
        )
        rec.max_budget = max((c.tokens for c in out.consumed), default=0)
        self.ledger.consume(step, out.consumed)
        self.result.steps.append(rec)
        if self.mode == "april-async":  # a call lists only the groups it claimed
            rec.buffered_groups = len(self.ledger.outstanding())
        if self.mode == "april-async" and step + 1 < self.cfg.steps:
            p0 = time.perf_counter()
            rec.prefetched_groups = await self.prefetch(step + 1)
            rec.prefetch_s = time.perf_counter() - p0
            self.run_windows.append((p0 - poller.t0, p0 - poller.t0 + rec.prefetch_s))

    async def finish(self, poller: LoadPoller) -> ModeResult:
        """Mode-local timeline (this mode's rollout phases only, end to end), leftover, checks.
        Idempotent; must run before another APRIL mode starts (it frees this mode's buffer)."""
        if self.finished:
            return self.result
        self.finished = True
        self.result.timeline = [
            (local + t - a0, r)
            for a0, a1, local in self.windows
            for t, r in poller.samples
            if a0 <= t <= a1
        ]
        self.result.run_idle_frac = windows_idle_frac(poller.samples, self.run_windows)
        if self.mode == "april-async" and self.result.available:
            # Stop our background work first, so that what is counted as leftover stays put
            # and every token it generated is in the server's tally.
            await abort_groups(self.http, sorted(self.ledger.outstanding()))
            self.result.background_tokens = await background_tokens(self.http) - self.background0
        await self.collect_leftover()
        # A mode found unavailable mid-step did not record what it received: nothing to check.
        self.result.checks = self.ledger.check() if self.result.available else []
        self.note_staleness()
        if self.wl.kind in ("natural", "text"):  # lengths the model chose: worth describing
            prompts = self.wl.prompts if self.wl.kind == "text" else None
            self.result.lengths = length_figures(self.ledger, self.cfg.max_tokens, prompts)
        if self.mode != "sync":
            end = await self.prediction_score()
            self.result.length_prediction = score_delta(self.pred0, end) if end else None
        return self.result

    async def prediction_score(self) -> dict[str, Any] | None:
        """The server's length-prediction score so far (cumulative over its life)."""
        stats = check(await self.http.get(R + "/stats"), "GET /stats")
        figures: dict[str, Any] | None = stats.get("length_prediction")
        return figures

    def note_staleness(self) -> None:
        limit = self.cfg.max_staleness
        if limit is None:
            return
        over = sum(t for r in self.result.steps for lag, t in r.staleness.items() if lag > limit)
        if over:
            self.result.notes.append(
                f"{over} consumed tokens were more than max_staleness={limit} versions old"
            )

    # ---- sync ---------------------------------------------------------------------------------

    async def sync_step(self, step: int) -> StepOutcome:
        groups = self.draw(self.cfg.groups)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(self.sync_group(g, t0, step) for g in groups))
        wall = time.perf_counter() - t0
        consumed = [c for group in outs for c, _ in group]
        hist: dict[int, int] = {}
        for group in outs:
            for c, v in group:
                add(hist, version_lag(v, self.version, self.history), c.tokens)
        tokens = sum(c.tokens for c in consumed)
        rec = StepRecord(
            step,
            wall,
            wall,
            len(consumed),
            tokens,
            tokens,
            offpolicy_tokens=offpolicy_tokens(hist),
            weight_version=self.version,
            staleness=hist,
        )
        return StepOutcome(rec, consumed)

    async def sync_group(self, g: WorkGroup, t0: float, step: int) -> list[tuple[Consumed, str]]:
        members = await asyncio.gather(*(self.generate(g, j) for j in range(g.n)))
        self.result.group_latencies.append(time.perf_counter() - t0)
        self.tick(step)
        return members

    async def generate(self, g: WorkGroup, j: int) -> tuple[Consumed, str]:
        params = g.sampling_params(self.cfg.max_tokens, self.cfg.temperature)
        params["max_new_tokens"] = g.budgets[j] if g.ignore_eos else self.cfg.max_tokens
        body = {
            **self.prompt(g),
            "sampling_params": params,
            "return_logprob": True,
            "stream": self.cfg.stream_sync,
        }
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

    def group_spec(self, g: WorkGroup) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "group_id": self.gid(g),
            **self.prompt(g),
            "n": g.n,
            "sampling_params": g.sampling_params(cfg.max_tokens, cfg.temperature),
            "member_params": g.member_params(),
            "metadata": {"answer": g.answer},
        }

    async def prefetch(self, step: int) -> int:
        """april-async: hand in `step`'s new groups now, generating in the background, so that
        the call of `step` sends none. Returns how many were handed in."""
        groups = self.draw(max(0, self.want - self.outstanding()))
        if not groups:
            return 0
        body = {
            "groups": [self.group_spec(g) for g in groups],
            "start": "background",
            "max_staleness": self.cfg.max_staleness,
            "request_id": f"{self.cfg.run_tag}-{self.spec.slug}-p{step}",
        }
        out = check(await self.http.post(R + "/groups", json=body), "POST /groups")
        if out.get("group_ids") != [self.gid(g) for g in groups]:
            raise BenchError(f"POST /groups answered {out.get('group_ids')!r} for {len(groups)}")
        return len(groups)

    async def april_step(self, step: int) -> StepOutcome:
        cfg = self.cfg
        outstanding = self.outstanding()
        groups = self.draw(max(0, self.want - outstanding))
        body = {
            "groups": [self.group_spec(g) for g in groups],
            "target_groups": cfg.groups,
            "resume_first": True,
            "on_quota": ON_QUOTA[self.mode],
            "max_staleness": cfg.max_staleness,
            "max_inflight_groups": self.inflight(outstanding + len(groups)),
            "length_order": LENGTH_ORDER.get(self.mode),
            "stream": True,
            "request_id": f"{cfg.run_tag}-{self.spec.slug}-s{step}",
        }
        t0 = time.perf_counter()
        finished: list[dict[str, Any]] = []
        ttq: float | None = None
        stats: dict[str, Any] = {}
        buffered: list[str] = []
        async for ev in rollout_events(self.http, body):
            if ev["event"] == "group_finished":
                finished.append(ev["group"])
                self.result.group_latencies.append(time.perf_counter() - t0)
                if len(finished) == cfg.groups:
                    ttq = time.perf_counter() - t0
                self.tick(step)
            elif ev["event"] == "done":
                stats, buffered = ev["stats"], ev["buffered_group_ids"]
        self.advised = int(stats.get("groups_wanted") or 0)
        wall = time.perf_counter() - t0
        self.buffered = buffered
        if self.mode == "april-kv" and stats.get("on_quota_effective") != "snapshot":
            self.result.available = False
            self.result.reason = (
                f"the server ran on_quota=snapshot as {stats.get('on_quota_effective')!r}: "
                "no KV snapshots in this build"
            )
        version = str(stats.get("weight_version", self.version))
        consumed = [
            Consumed(s["sample_id"], grp["group_id"], s["index"], len(s["output_ids"]), s["status"])
            for grp in finished
            for s in grp["samples"]
        ]
        hist = sample_histogram((s for g in finished for s in g["samples"]), version, self.history)
        rec = StepRecord(
            step,
            wall,
            ttq if ttq is not None else float(stats.get("time_to_quota_s") or wall),
            len(consumed),
            sum(c.tokens for c in consumed),
            int(stats.get("output_tokens", 0)),
            offpolicy_tokens=offpolicy_tokens(hist),
            staleness=hist,
            restored_kv_tokens=int(stats.get("restored_kv_tokens", 0)),
            recomputed_tokens=int(stats.get("recomputed_tokens", 0)),
            resumed_samples=int(stats.get("resumed_samples", 0)),
            buffered_groups=len(buffered),
            weight_version=version,
            inflight_target=stats.get("inflight_target"),
            extra_groups=stats.get("extra_groups"),
            goodput_expected=stats.get("goodput_expected_tok_s"),
            goodput_sync=stats.get("goodput_sync_tok_s"),
            goodput_got=stats.get("goodput_tok_s"),
            call_wall_s=stats.get("wall_s"),
            groups_wanted=stats.get("groups_wanted"),
        )
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
