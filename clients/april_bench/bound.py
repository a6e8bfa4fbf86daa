"""The engine's no-bubble bound, measured on the same server before the modes.

A rollout step can be no faster than its tokens divided by the engine's saturated generation
throughput: what it reaches with an unlimited backlog, never waiting for a straggler. So before
the modes, `april-bench` keeps a closed-loop backlog of the workload's own samples on SGLang's
`/generate` (the same prompts, budgets, sampling and EOS rule the modes get; a sample that
finishes is replaced at once) at each concurrency 8, 16, 32, ... up to what the engine holds
(its `max_running_requests`, and what its KV pool holds at the workload's mean prompt plus
budget; it stops early once the running batch no longer follows the concurrency: the pool is
full). At each level it lets the running set turn over (until as many samples finished as run,
or a time cap), then counts the tokens generated in a window: the engine's own counters
(`/stats` `engine_time`: decode tokens plus one first token per prefilled request) over the
window's wall time. The best level's tokens per second is the bound; its new prompts' prefill,
SGLang's scheduling and HTTP are inside it, as they are inside every mode.

Time per level is shared out in proportion to its concurrency (a big batch takes longer to
turn over), `budget_s` in all, each at least a few seconds (a phase too short for every level
leaves out the smallest); a level cut short by its cap says so (`settled` false).

The levels up to the best are measured again after the modes (`measure_again`), on the same
server, and keep the faster of their two windows: a window of a second or two is at the mercy
of whatever else the machine ran then, and an engine minutes into its life can step faster
than one just warmed up (APRIL's decode step at batch 59 took 5.65 ms in one run where the
bound's level 64, minutes earlier on the same server, had taken 6.7 ms at batch 63). So the
bound errs high rather than low (every fraction of it errs low), and the staleness ceiling
(`staleness_ceiling.py`) reads the engine's cost at those batches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from .server_api import R, check, engine_clock
from .workload import PROMPT_LEN, Workload, lognormal_params

FIRST_LEVEL = 8
SETTLE_SHARE = 0.4  # of a level's time: letting the running set turn over before the window
MIN_WINDOW_S = 1.0
LEVEL_MIN_WINDOWS = 2.5  # a level gets at least this many minimal windows of time
FULL_SHARE = 0.95  # the knee: the smallest level within 5 % of the best
KV_FULL = 0.75  # a mean decode batch below this share of the concurrency: the pool is full
BOUND_INDEX = 3 * 10**6  # the backlog's groups, outside the modes' stream and the warm-up's
AGAIN_INDEX = 4 * 10**6  # the second pass's


@dataclass
class BoundLevel:
    concurrency: int
    window_s: float
    tokens: int  # generated in the window
    mean_batch: float | None  # decode tokens / decode steps in the window
    step_ms: float | None  # decode seconds per decode step
    mean_context: float | None  # tokens attended per decoding request
    forward_share: float | None  # share of the window inside forward passes
    idle_share: float | None  # share of the window the scheduler had no batch to run
    settled: bool  # the running set turned over before the window opened
    other_tok_s: float | None = None  # measured again: the slower window's rate, not kept

    @property
    def tok_s(self) -> float:
        return self.tokens / self.window_s if self.window_s > 0 else 0.0


@dataclass
class Bound:
    levels: list[BoundLevel] = field(default_factory=list)
    capacity: tuple[int, int] | None = None  # (max running requests, KV pool tokens)
    level_cap: int = 0  # the largest concurrency the engine holds, as estimated
    phase_s: float = 0.0
    stopped: str = ""  # why no larger level was measured
    budgets: list[float] = field(default_factory=list)  # each level's share of the phase

    @property
    def best(self) -> BoundLevel | None:
        return max(self.levels, key=lambda lv: lv.tok_s, default=None)

    @property
    def tok_s(self) -> float | None:
        best = self.best
        return None if best is None or best.tok_s <= 0 else best.tok_s

    @property
    def knee(self) -> BoundLevel | None:
        """The smallest level within `FULL_SHARE` of the best: a batch that fills the engine."""
        best = self.tok_s
        if best is None:
            return None
        by_size = sorted(self.levels, key=lambda x: x.concurrency)
        return next(lv for lv in by_size if lv.tok_s >= FULL_SHARE * best)

    @property
    def full_batch(self) -> int | None:
        """The decode batch counted as full: the knee's mean decode batch (its concurrency
        without the engine clock)."""
        knee = self.knee
        if knee is None:
            return None
        return max(1, round(knee.mean_batch if knee.mean_batch else knee.concurrency))

    def to_json(self) -> dict[str, Any]:
        best, knee = self.best, self.knee
        return {
            "bound_tok_s": None if self.tok_s is None else round(self.tok_s, 3),
            "bound_concurrency": None if best is None else best.concurrency,
            "bound_mean_batch": None if best is None else best.mean_batch,
            "bound_knee_concurrency": None if knee is None else knee.concurrency,
            "bound_full_batch": self.full_batch,
            "bound_capacity": None if self.capacity is None else list(self.capacity),
            "bound_level_cap": self.level_cap,
            "bound_phase_s": round(self.phase_s, 2),
            "bound_stopped": self.stopped,
            "bound_levels": [{**asdict(lv), "tok_s": round(lv.tok_s, 3)} for lv in self.levels],
        }


def mean_need(wl: Workload, max_tokens: int) -> float:
    """KV tokens one backlog sample ends with, on average: its prompt plus its budget (the
    long-tail lognormal's mean, clipped at the maximum, without drawing; the full budget for
    workloads whose lengths the model decides)."""
    prompt = sum(PROMPT_LEN) / 2
    if wl.kind != "longtail":
        return prompt + max_tokens
    mu, sigma = lognormal_params(max_tokens)
    # E[min(X, m)] of a lognormal X, by a fine quadrature over its quantiles.
    from statistics import NormalDist

    nd, steps = NormalDist(mu, sigma), 2000
    total = 0.0
    for i in range(steps):
        x = pow(2.718281828459045, nd.inv_cdf((i + 0.5) / steps))
        total += min(max(x, 1.0), float(max_tokens))
    return prompt + total / steps


def levels(cap: int, first: int = FIRST_LEVEL) -> list[int]:
    """8, 16, 32, ... below `cap`, then `cap` itself."""
    out: list[int] = []
    c = max(1, first)
    while c < cap:
        out.append(c)
        c *= 2
    out.append(max(1, cap))
    return out


def level_budgets(concurrencies: list[int], budget_s: float) -> list[float]:
    """Each level's share of the phase, in proportion to its concurrency, at least 2.5 windows'
    minimum."""
    total = sum(concurrencies) or 1
    return [max(LEVEL_MIN_WINDOWS * MIN_WINDOW_S, budget_s * c / total) for c in concurrencies]


def window_tokens(
    before: dict[str, float], after: dict[str, float]
) -> tuple[int, dict[str, float]]:
    """Tokens generated between two engine clock readings: decode tokens plus one first token
    per prefilled request; and the clock's deltas."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return int(delta.get("decode_tokens", 0) + delta.get("prefill_requests", 0)), delta


class Backlog:
    """A closed loop of `/generate` requests over the workload's samples: `resize(c)` keeps `c`
    in flight, each replaced as it finishes; `stop()` aborts what is left."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        wl: Workload,
        max_tokens: int,
        temperature: float,
        tag: str,
        first_group: int = BOUND_INDEX,
    ) -> None:
        self.http, self.wl, self.tag = http, wl, tag
        self.max_tokens, self.temperature = max_tokens, temperature
        self.samples = self._samples(first_group)
        self.workers: list[asyncio.Task[None]] = []
        self.in_flight: set[str] = set()
        self.finished = 0
        self.stopping = False
        self.errors: list[str] = []

    def _samples(self, first_group: int) -> Iterator[dict[str, Any]]:
        i = 0
        while True:
            g = self.wl.group(first_group + i)
            prompt = (
                {"input_ids": list(g.input_ids)} if g.input_ids is not None else {"text": g.text}
            )
            for j, budget in enumerate(g.budgets):
                params = g.sampling_params(self.max_tokens, self.temperature)
                params["max_new_tokens"] = budget if g.ignore_eos else self.max_tokens
                yield {**prompt, "sampling_params": params, "rid": f"{self.tag}-{i}-{j}"}
            i += 1

    async def _work(self) -> None:
        while not self.stopping:
            body = next(self.samples)
            rid = body["rid"]
            self.in_flight.add(rid)
            try:
                resp = await self.http.post("/generate", json=body)
                if resp.status_code >= 400 and not self.stopping:
                    self.errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
                    return
            finally:
                self.in_flight.discard(rid)
            if not self.stopping:
                self.finished += 1

    def resize(self, concurrency: int) -> None:
        while len(self.workers) < concurrency:
            self.workers.append(asyncio.get_running_loop().create_task(self._work()))

    async def stop(self) -> None:
        self.stopping = True
        for rid in list(self.in_flight):
            await self.http.post("/abort_request", json={"rid": rid})
        await asyncio.gather(*self.workers, return_exceptions=True)


async def capacity(http: httpx.AsyncClient) -> tuple[int, int] | None:
    """(max running requests, KV pool tokens) from `/stats`; None when it does not say."""
    stats = check(await http.get(R + "/stats"), "GET stats")
    run, tokens = stats.get("max_running_requests"), stats.get("max_total_tokens")
    if not run or not tokens:
        return None
    return int(run), int(tokens)


async def measure_bound(
    http: httpx.AsyncClient,
    wl: Workload,
    max_tokens: int,
    temperature: float,
    budget_s: float,
    tag: str = "bound",
) -> Bound:
    t0 = time.perf_counter()
    if not await engine_clock(http):
        return Bound(
            stopped="not measured: the server reports no engine clock (/stats engine_time)"
        )
    cap_info = await capacity(http)
    need = mean_need(wl, max_tokens)
    cap = 512 if cap_info is None else max(1, min(cap_info[0], int(cap_info[1] / need)))
    plan = levels(cap)
    while len(plan) > 1 and LEVEL_MIN_WINDOWS * MIN_WINDOW_S * len(plan) > budget_s:
        plan.pop(0)  # a short phase keeps the large levels: the bound is found there
    budgets = level_budgets(plan, budget_s)
    out = Bound(capacity=cap_info, level_cap=cap)
    backlog = Backlog(http, wl, max_tokens, temperature, f"{tag}-{int(time.time())}")
    try:
        for c, level_s in zip(plan, budgets, strict=True):
            lv = await measure_level(backlog, http, c, level_s)
            if backlog.errors:
                out.stopped = f"a backlog request failed: {backlog.errors[0]}"
                break
            out.levels.append(lv)
            if lv.mean_batch is not None and lv.mean_batch < KV_FULL * c:
                out.stopped = (
                    f"at concurrency {c} the decode batch averaged {lv.mean_batch:.0f}: the "
                    "engine holds no more"
                )
                break
        else:
            out.stopped = f"concurrency {cap}: the most the engine holds (estimated)"
    finally:
        await backlog.stop()
    out.budgets = budgets[: len(out.levels)]
    out.phase_s = time.perf_counter() - t0
    return out


async def measure_again(
    http: httpx.AsyncClient,
    wl: Workload,
    max_tokens: int,
    temperature: float,
    bound: Bound,
    tag: str = "bound",
) -> None:
    """The second pass (module doc): the levels up to the best, each for the time it had
    before, on a fresh backlog of prompts of its own (the first pass's would find their
    prefixes in the cache); each keeps the faster of its two windows."""
    best = bound.best
    if best is None or len(bound.budgets) != len(bound.levels):
        return  # not measured by `measure_bound`: no time per level to give again
    t0 = time.perf_counter()
    again = [
        (lv.concurrency, level_s)
        for lv, level_s in zip(bound.levels, bound.budgets, strict=True)
        if lv.concurrency <= best.concurrency
    ]
    backlog = Backlog(
        http, wl, max_tokens, temperature, f"{tag}-again-{int(time.time())}", AGAIN_INDEX
    )
    second: list[BoundLevel] = []
    try:
        for c, level_s in again:
            lv = await measure_level(backlog, http, c, level_s)
            if backlog.errors:
                bound.stopped += f"; the second pass stopped: {backlog.errors[0]}"
                break
            second.append(lv)
    finally:
        await backlog.stop()
    bound.levels = keep_faster(bound.levels, second)
    bound.phase_s += time.perf_counter() - t0


def keep_faster(levels: list[BoundLevel], again: list[BoundLevel]) -> list[BoundLevel]:
    """Each level measured again keeps the faster of its two windows, the other's rate noted."""
    second = {lv.concurrency: lv for lv in again}
    out: list[BoundLevel] = []
    for lv in levels:
        other = second.get(lv.concurrency)
        if other is None:
            out.append(lv)
            continue
        keep, drop = (lv, other) if lv.tok_s >= other.tok_s else (other, lv)
        out.append(replace(keep, other_tok_s=round(drop.tok_s, 3)))
    return out


async def measure_level(
    backlog: Backlog, http: httpx.AsyncClient, c: int, level_s: float
) -> BoundLevel:
    """Grow the backlog to `c`, let it turn over, then measure a window."""
    start = time.perf_counter()
    settle_until = start + SETTLE_SHARE * level_s
    backlog.resize(c)
    first = backlog.finished
    while backlog.finished - first < c and time.perf_counter() < settle_until:
        await asyncio.sleep(0.05)
    settled = backlog.finished - first >= c
    clock0, w0 = await engine_clock(http), time.perf_counter()
    end_by = max(start + level_s, w0 + MIN_WINDOW_S)
    mark = backlog.finished
    while time.perf_counter() < end_by and not (
        backlog.finished - mark >= c and time.perf_counter() - w0 >= MIN_WINDOW_S
    ):
        await asyncio.sleep(0.05)
    clock1, w1 = await engine_clock(http), time.perf_counter()
    tokens, d = window_tokens(clock0, clock1)
    steps = d.get("decode_batches", 0.0)
    dec_tokens = d.get("decode_tokens", 0.0)
    forwards = d.get("decode_s", 0.0) + d.get("prefill_s", 0.0)
    return BoundLevel(
        concurrency=c,
        window_s=round(w1 - w0, 4),
        tokens=tokens,
        mean_batch=round(dec_tokens / steps, 2) if steps else None,
        step_ms=round(1e3 * d.get("decode_s", 0.0) / steps, 3) if steps else None,
        mean_context=round(d.get("decode_context_tokens", 0.0) / dec_tokens, 1)
        if dec_tokens
        else None,
        forward_share=round(forwards / (w1 - w0), 4) if w1 > w0 and clock1 else None,
        idle_share=round(d["idle_s"] / (w1 - w0), 4) if w1 > w0 and "idle_s" in d else None,
        settled=settled,
    )


def bound_line(b: dict[str, Any]) -> str:
    """How the bound was measured, in one printed paragraph."""
    if b.get("bound_tok_s") is None:
        return f"bound: {b.get('bound_stopped') or 'not measured'}"
    levels_txt = ", ".join(
        f"{lv['concurrency']}: {lv['tok_s']:.0f}"
        + ("" if lv["mean_batch"] is None else f" (batch {lv['mean_batch']:.0f})")
        + ("" if lv["settled"] else "*")
        + ("" if lv.get("other_tok_s") is None else f" [{lv['other_tok_s']:.0f}]")
        for lv in b["bound_levels"]
    )
    return (
        f"bound (engine's saturated generation, closed-loop backlog of the workload on /generate, "
        f"{b['bound_phase_s']:.0f} s): {b['bound_tok_s']:.1f} tok/s at concurrency "
        f"{b['bound_concurrency']}; full batch (knee, within 5 % of it) {b['bound_full_batch']}; "
        f"tok/s by concurrency: {levels_txt} (* cut by its time cap before turning over; "
        f"[n]: measured again, the slower window's rate); stopped: {b['bound_stopped']}"
    )
