"""Metrics of one mode's run: per step, overall, latency percentiles.

Definitions (printed by `april-bench --help-metrics`):
- rollout wall: submit of the step's requests -> the trainer holds K whole groups (abort and
  drain included for APRIL). Training time and weight updates are outside it.
- output_throughput: tokens of the *consumed* samples / rollout wall (tokens/s), APRIL's headline;
  for APRIL the consumed tokens include ones generated in earlier steps (the partial buffer).
- generated_throughput: tokens the engine generated during rollouts / rollout wall (april-async's
  background tokens, generated between calls, are not in it; they are in generated_tokens).
- time to quota: submit -> the K-th whole group finished (sync: the last one).
- mean running batch: time-weighted mean of SGLang's `num_running_reqs` during rollouts;
  idle_frac: share of rollout time with none running; tail_frac: share with fewer than half the
  step's consumed batch (K x n) running (the long-tail bubble).
- off-policy fraction: consumed tokens generated under an older weight version than the one
  current when the step was consumed / consumed tokens.
- staleness histogram (`staleness_hist`): consumed tokens by how many weight versions older
  they are than the version current when the step was consumed (0 = on-policy; `?` = a version
  the bench did not push); `max_staleness_seen` is the largest lag.
- run wall (`run_wall_s`): what the trainer lives through, per step: the rollout wall, the
  prefetch (april-async: handing in the next step's groups), the training wait (`--train-s`)
  and the weight push. `wall_throughput` = consumed tokens / run wall (the end-to-end figure:
  generation that overlaps training shows here, not in output_throughput).
  `steady_wall_throughput`: the same over every step but the first, which has nothing
  generated ahead of it (april-async's cold start): what a run of many steps approaches.
- run_idle_frac: share of the run wall with no request running in SGLang (`/v1/loads`, which
  counts background generation too), training periods included; sync idles while it trains.
- weight push latency (`push_p50_s`, `push_max_s`): `/update_weights_from_disk` round trips
  after each step, against `idle_push_s`, one push with nothing running at the mode's start.
- tokens wasted: generated - consumed - still buffered at the end (discarded work).
  april-async's generated tokens include `background_tokens`: those generated between its calls
  (`/stats` background_output_tokens, from the mode's start to its end, after its leftover
  was stopped with `/abort`), so its ledger closes like the others'.
- engine time: the server's own clock of seconds inside SGLang forward batches during the
  step's rollout wall, split into prefill (first prefill and re-prefill of continuations;
  `engine_prefill_tokens`) and decode (`engine_decode_steps`, `engine_mean_decode_batch` =
  decoded tokens / decode steps, `engine_mean_decode_context` = mean sequence length of a
  decoding request); `engine_other_s` = wall - both (scheduling, HTTP, abort and
  persistence, the engine idle). Compute time on CPU; launch time only under SGLang's overlap
  scheduler on a GPU.
  april-async: the clock is read around each call, so background forwards that ran between the
  reading and the call pausing them are in it too (engine_other_s can go below 0).
- bound (`bound_tok_s`, `bound.py`): the engine's saturated generation throughput, measured
  on the same server before the modes: a closed-loop backlog of the workload's own samples on
  `/generate` at concurrency 8, 16, ... up to what the engine holds; the best level's tokens
  per second. `x bound` (`output_throughput_vs_bound`) = a mode's consumed tokens per rollout
  second over it; `bound_full_batch` = the mean decode batch of the smallest level within 5 %
  of the best (the knee). `wall x bound` (`wall_throughput_vs_bound`): the same over the run
  wall (pushes, prefetch and training included): for april-async, whose background also
  generates between calls, the stricter of the two. `steady x bound`: the run wall's figure
  over every step but the first (a cold start; what a run of many steps approaches, though
  the work in progress when the last step ends still counts against it).
- thrown away (`thrown_away_share`) = tokens_wasted / generated; never consumed
  (`unconsumed_share`) = leftover / generated.
- wall by cause (`wall_by_cause`, `gap.py`): decode forwards at a full batch (the knee's batch
  bucket and above) and below it, prefill of resumed work (the prefill time's share of
  recomputed tokens) and of new prompts, outside forwards; they add up to the rollout wall.
- the gap (`gap_to_bound`): shares of bound x rollout wall: `consumed` (= x bound), outside
  forwards, prefill, decode below the bound's rate (bound x decode s - generated), generated
  but not consumed; they add up to 1.
- TTFT / TPOT / ITL / E2E follow sglang.bench_serving: TPOT = (E2E - TTFT) / (tokens - 1),
  ITL = gaps between streamed chunks; `{mean,median,std,p90,p95,p99}_{name}_ms`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .staleness import merge

PERCENTILES = (90, 95, 99)
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2e_latency")


@dataclass
class Latencies:
    """Per-request latencies in seconds (sync mode streams /generate to measure them)."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e_latency: list[float] = field(default_factory=list)

    def add_request(self, start: float, chunk_times: Sequence[float], tokens: int) -> None:
        if not chunk_times:
            return
        end = chunk_times[-1]
        self.ttft.append(chunk_times[0] - start)
        self.e2e_latency.append(end - start)
        if tokens > 1:
            self.tpot.append((end - chunk_times[0]) / (tokens - 1))
        self.itl.extend(b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False))

    def add_e2e(self, seconds: float) -> None:
        self.e2e_latency.append(seconds)

    def summary(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name in LATENCY_NAMES:
            vals = np.asarray(getattr(self, name), dtype=float) * 1000.0
            have = vals.size > 0
            out[f"mean_{name}_ms"] = float(vals.mean()) if have else None
            out[f"median_{name}_ms"] = float(np.median(vals)) if have else None
            out[f"std_{name}_ms"] = float(vals.std()) if have else None
            for p in PERCENTILES:
                out[f"p{p}_{name}_ms"] = float(np.percentile(vals, p)) if have else None
        return out


def timeline_stats(
    samples: Sequence[tuple[float, int]], t0: float, t1: float, full_batch: int
) -> tuple[float, float, float]:
    """(time-weighted mean running, idle fraction, tail fraction) over [t0, t1], treating each
    sample as holding until the next one."""
    pts = [(t, r) for t, r in samples if t0 <= t <= t1]
    before = [r for t, r in samples if t < t0]
    if before:
        pts.insert(0, (t0, before[-1]))
    if t1 <= t0 or not pts:
        return 0.0, 0.0, 0.0
    total = idle = tail = area = 0.0
    for i, (t, r) in enumerate(pts):
        end = pts[i + 1][0] if i + 1 < len(pts) else t1
        dt = max(0.0, end - max(t, t0))
        total += dt
        area += r * dt
        idle += dt if r == 0 else 0.0
        tail += dt if r < full_batch / 2 else 0.0
    if total <= 0:
        return float(pts[-1][1]), 0.0, 0.0
    return area / total, idle / total, tail / total


def windows_idle_frac(
    samples: Sequence[tuple[float, int]], windows: Sequence[tuple[float, float]]
) -> float:
    """Share of the time inside `windows` (each `(t0, t1)`) with no request running."""
    total = sum(max(0.0, b - a) for a, b in windows)
    if total <= 0:
        return 0.0
    idle = sum(timeline_stats(samples, a, b, 1)[1] * (b - a) for a, b in windows if b > a)
    return idle / total


def wall_throughput(consumed_tokens: int, spans: Sequence[float]) -> float | None:
    """Consumed tokens per second of the trainer's whole loop (rollouts and training)."""
    wall = sum(spans)
    return consumed_tokens / wall if wall > 0 else None


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


@dataclass
class StepRecord:
    step: int
    wall_s: float
    time_to_quota_s: float
    consumed_samples: int
    consumed_tokens: int
    generated_tokens: int
    offpolicy_tokens: int = 0
    restored_kv_tokens: int = 0
    recomputed_tokens: int = 0
    resumed_samples: int = 0
    buffered_groups: int = 0
    mean_running: float = 0.0
    idle_frac: float = 0.0
    tail_frac: float = 0.0
    inflight_target: int | None = None  # APRIL "auto": the running batch the server chose
    # APRIL "auto": the groups beyond the quota the server let the call keep in progress, the
    # goodput (tokens within max_staleness per second) its play expected, a synchronous
    # trainer's, and what the call got; the pool it advised for the next call.
    extra_groups: int | None = None
    goodput_expected: float | None = None
    goodput_sync: float | None = None
    goodput_got: float | None = None
    call_wall_s: float | None = None  # the server's wall of the call, which `goodput_got` is over
    groups_wanted: int | None = None
    max_budget: int = 0  # longest consumed sample (calibrates the simulator on sync steps)
    weight_version: str = ""  # current when the step was consumed
    staleness: dict[int, int] = field(default_factory=dict)  # lag in versions -> consumed tokens
    # The trainer's time after the call: handing in the next step's groups (april-async), the
    # training wait, the weight push that ends it (None: no push after this step).
    prefetch_s: float = 0.0
    prefetched_groups: int = 0
    train_s: float = 0.0
    push_s: float | None = None
    # Engine forward time inside this step (server's `engine_time` before/after): where the
    # step's wall time went. None when the server does not report it.
    prefill_s: float | None = None
    prefill_tokens: int = 0
    decode_s: float | None = None
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_context_tokens: int = 0
    prefill_requests: int = 0  # requests prefilled: each made its first token there
    engine_idle_s: float | None = None  # the scheduler had no batch to run (waiting for work)
    # Decode forwards by batch-size bucket (`engine/clock.py` batch_bucket): lower edge ->
    # [seconds, steps, tokens]; splits decode time at a full batch from the tail's.
    decode_by_bucket: dict[int, list[float]] = field(default_factory=dict)
    t_start: float = 0.0  # seconds since the mode started
    t_end: float = 0.0

    @property
    def output_throughput(self) -> float:
        return self.consumed_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def span_s(self) -> float:
        """The step as the trainer lives it: rollout, prefetch, training, push."""
        return self.wall_s + self.prefetch_s + self.train_s + (self.push_s or 0.0)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["output_throughput"] = round(self.output_throughput, 3)
        d["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        d["decode_by_bucket"] = {str(k): v for k, v in sorted(self.decode_by_bucket.items())}
        d["span_s"] = round(self.span_s, 4)
        return d


def engine_time_totals(steps: list[StepRecord], wall: float) -> dict[str, Any]:
    """Where the rollout wall time went: prefill forwards (first prefill and re-prefill of
    continuations), decode forwards, and the rest (scheduling, HTTP, abort and persistence,
    the engine idle). Empty when the server reported no engine clock."""
    if not steps or any(r.prefill_s is None or r.decode_s is None for r in steps):
        return {}
    prefill = sum(r.prefill_s or 0.0 for r in steps)
    decode = sum(r.decode_s or 0.0 for r in steps)
    decode_steps = sum(r.decode_steps for r in steps)
    buckets: dict[int, list[float]] = {}
    for r in steps:
        for edge, figures in r.decode_by_bucket.items():
            acc = buckets.setdefault(edge, [0.0, 0.0, 0.0])
            for i, v in enumerate(figures):
                acc[i] += v
    return {
        "engine_prefill_s": round(prefill, 4),
        "engine_prefill_tokens": sum(r.prefill_tokens for r in steps),
        "engine_decode_s": round(decode, 4),
        "engine_decode_steps": decode_steps,
        "engine_decode_tokens": sum(r.decode_tokens for r in steps),
        "engine_mean_decode_context": round(
            sum(r.decode_context_tokens for r in steps)
            / max(1, sum(r.decode_tokens for r in steps)),
            1,
        ),
        "engine_mean_decode_batch": round(sum(r.decode_tokens for r in steps) / decode_steps, 3)
        if decode_steps
        else None,
        "engine_other_s": round(wall - prefill - decode, 4),
        "engine_prefill_requests": sum(r.prefill_requests for r in steps),
        "engine_idle_s": None
        if any(r.engine_idle_s is None for r in steps)
        else round(sum(r.engine_idle_s or 0.0 for r in steps), 4),
        "engine_decode_by_bucket": {
            str(k): [round(v[0], 6), int(v[1]), int(v[2])] for k, v in sorted(buckets.items())
        },
    }


@dataclass
class ModeResult:
    mode: str
    available: bool = True
    reason: str | None = None
    steps: list[StepRecord] = field(default_factory=list)
    latencies: Latencies = field(default_factory=Latencies)
    group_latencies: list[float] = field(default_factory=list)  # submit -> group finished (s)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s since start, running)
    leftover_groups: int = 0
    leftover_tokens: int = 0
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    idle_push_s: float | None = None  # one weight push with nothing running, at the start
    background_tokens: int = 0  # generated between calls (april-async), not in any call's stats
    run_idle_frac: float | None = None  # over every step's span (rollout and training)
    lengths: dict[str, Any] = field(default_factory=dict)  # consumed lengths (length_stats.py)
    length_prediction: dict[str, Any] | None = None  # the server's /stats figures, at the end

    def totals(self) -> dict[str, Any]:
        s = self.steps
        wall = sum(r.wall_s for r in s)
        consumed = sum(r.consumed_tokens for r in s)
        in_calls = sum(r.generated_tokens for r in s)
        generated = in_calls + self.background_tokens
        stale = merge(r.staleness for r in s)
        pushes = [r.push_s for r in s if r.push_s is not None]
        run_tp = wall_throughput(consumed, [r.span_s for r in s])
        later = s[1:]
        steady_tp = wall_throughput(
            sum(r.consumed_tokens for r in later), [r.span_s for r in later]
        )
        samples = sum(r.consumed_samples for r in s)

        def weighted(attr: str) -> float:
            return sum(getattr(r, attr) * r.wall_s for r in s) / wall if wall else 0.0

        g = np.asarray(self.group_latencies, dtype=float) * 1000.0
        return {
            "rollout_wall_s": round(wall, 4),
            "consumed_samples": samples,
            "consumed_tokens": consumed,
            "generated_tokens": generated,
            "generated_in_calls": in_calls,
            "output_throughput": round(consumed / wall, 3) if wall else None,
            "samples_per_s": round(samples / wall, 4) if wall else None,
            "generated_throughput": round(in_calls / wall, 3) if wall else None,
            "mean_time_to_quota_s": round(sum(r.time_to_quota_s for r in s) / len(s), 4)
            if s
            else None,
            "mean_running": round(weighted("mean_running"), 3),
            "idle_frac": round(weighted("idle_frac"), 4),
            "tail_frac": round(weighted("tail_frac"), 4),
            "offpolicy_frac": round(sum(r.offpolicy_tokens for r in s) / consumed, 4)
            if consumed
            else 0.0,
            "run_wall_s": round(sum(r.span_s for r in s), 4),
            "train_s": round(sum(r.train_s for r in s), 4),
            "wall_throughput": None if run_tp is None else round(run_tp, 3),
            "steady_wall_throughput": None if steady_tp is None else round(steady_tp, 3),
            "run_idle_frac": None if self.run_idle_frac is None else round(self.run_idle_frac, 4),
            "staleness_hist": {str(k): v for k, v in stale.items()},
            "max_staleness_seen": max(stale, default=0),
            "push_count": len(pushes),
            "push_p50_s": _round(percentile(pushes, 50)),
            "push_max_s": _round(max(pushes, default=None)),
            "idle_push_s": _round(self.idle_push_s),
            "background_tokens": self.background_tokens,
            "tokens_wasted": generated - consumed - self.leftover_tokens,
            "leftover_groups": self.leftover_groups,
            "leftover_tokens": self.leftover_tokens,
            "restored_kv_tokens": sum(r.restored_kv_tokens for r in s),
            "recomputed_tokens": sum(r.recomputed_tokens for r in s),
            "resumed_samples": sum(r.resumed_samples for r in s),
            "inflight_targets": [r.inflight_target for r in s if r.inflight_target is not None],
            "extra_groups": [r.extra_groups for r in s],
            "goodput_expected": [r.goodput_expected for r in s],
            "goodput_sync": [r.goodput_sync for r in s],
            "goodput_got": [r.goodput_got for r in s],
            "goodput_got_run": run_rate([(r.goodput_got, r.call_wall_s) for r in s]),
            "groups_wanted": [r.groups_wanted for r in s],
            **engine_time_totals(s, wall),
            "median_group_latency_ms": float(np.median(g)) if g.size else None,
            "p99_group_latency_ms": float(np.percentile(g, 99)) if g.size else None,
        }


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def run_rate(per_call: Sequence[tuple[float | None, float | None]]) -> float | None:
    """A rate over the calls that report one, weighted by the walls it is over (the server's
    own, not the client's, which adds HTTP to each): a call that returns at once with groups
    that finished in an earlier call shows a huge rate of its own."""
    timed = [(r, w) for r, w in per_call if r is not None and w is not None and w > 0]
    wall = sum(w for _, w in timed)
    return round(sum(r * w for r, w in timed) / wall, 3) if wall > 0 else None
