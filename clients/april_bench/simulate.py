"""`--simulate`: a discrete-event model of the same RL loop. It is a SIMULATION, not a
measurement: every figure it prints follows from the cost model and assumptions it prints.

Model: E identical engines (an engine or a data-parallel rank: april-server places on both
alike) that share nothing; continuous batching. When a step starts every sample of it is
submitted at once and placed, one at a time in submission order (buffered groups first, then
fresh ones), by the routing policy:
- `least_loaded` (the default; what april-server does, april_server/rules/placement.py, whose own
  `plan_segment` decides here): a resumed sample with a usable KV snapshot (`april-kv`) goes to
  the engine holding the snapshot and restores it there; everything else to the engine with the
  fewest samples placed so far this step, then the least KV need (context + 0.7 x remaining
  budget, as the server counts it), then the lowest id;
- `round_robin` (the earlier model, kept for comparison): sample k of the step goes to engine
  k mod E; an `april-kv` sample landing on an engine other than its snapshot's re-prefills.
A sample's snapshot lives on the engine that ran its last segment (where it was interrupted);
in `april-kv` one always exists and is usable (unbounded host memory, reuse across the weight
update allowed); no KV moves between engines. Placement is fixed for the step: no mid-step
rebalancing, work stealing or queueing (no KV-capacity limit).

An engine first prefills what it was given (prompt tokens x `prefill_s`, plus for a resumed
sample its partial tokens re-prefilled (`april`, or `april-kv` off the snapshot's engine) or
restored (`restore_s` per token)), then decodes: every running sequence gains one token per
iteration, and an iteration with b sequences takes t(b) = a + c x b seconds. Between completions
b is constant, so the timeline is exact. The same workload stream and group accounting as the
real driver: sync waits for K whole groups; APRIL keeps ceil(over_sampling x K) groups in
flight, takes the first K to finish, aborts the rest at that instant and buffers their partial
tokens. A weight update happens between steps, so a token consumed at a later step than it was
generated is off-policy.

`sweep` runs the model at several engine counts. By default the batch scales with the engines
(weak scaling: K = groups_per_engine x E, so each engine sees the same load at every E); a fixed
K across engine counts (strong scaling) starves the larger ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from april_server.rules.inflight import kv_need
from april_server.rules.placement import Slot, SlotLoad, plan_segment

from .metrics import StepRecord
from .workload import Workload

ROUTINGS = ("least_loaded", "round_robin")
ROUTING_TEXT = {
    "least_loaded": "least_loaded (what april-server does): a resumed april-kv sample on the "
    "engine holding its snapshot, restored there; every other sample on the engine with the "
    "fewest samples placed this step, then least KV need (context + 0.7 x remaining budget), "
    "then lowest id",
    "round_robin": "round_robin (the earlier model, for comparison): sample k of a step on engine "
    "k mod E; an april-kv resume off its snapshot's engine re-prefills",
}
PLACEMENT_ASSUMPTIONS = (
    "every sample of a step is submitted when the step starts and placed one at a time, buffered "
    "groups first; placement is fixed for the step (no rebalancing, stealing or queueing)",
    "engines (or DP ranks) are identical and share nothing: a KV snapshot lives on the engine that "
    "interrupted the sample; in april-kv it always exists and is usable (unbounded host memory, "
    "reuse across the weight update allowed); no KV moves between engines",
)


@dataclass(frozen=True)
class CostModel:
    name: str
    a: float  # s per decode iteration, fixed part
    c: float  # s per running sequence per iteration
    prefill_s: float  # s per prefilled (or re-prefilled) token
    restore_s: float  # s per token restored from a KV snapshot
    assumptions: tuple[str, ...] = ()

    def step_time(self, b: int) -> float:
        return self.a + self.c * b


H200_8B = CostModel(
    "8B dense model (bf16) on H200, one engine per GPU (assumed constants, not measured)",
    a=6e-3,
    c=2e-4,
    prefill_s=4e-5,
    restore_s=2.6e-6,
    assumptions=(
        "a = 6 ms: 16 GB of weights read per iteration at ~3.4 TB/s effective HBM bandwidth "
        "plus ~1.5 ms scheduling/launch overhead (CUDA graphs)",
        "c = 0.2 ms per running sequence: ~4k-token average context x 128 KiB/token KV read at "
        "~3.4 TB/s, plus its share of compute; c does not grow with context length here",
        "prefill 40 us/token: 2 x 8e9 FLOP per token at ~400 TFLOP/s effective",
        "restore 2.6 us/token: 128 KiB/token over PCIe Gen5 at ~50 GB/s",
        "no KV-capacity limit, retraction or chunked-prefill overlap; no request submission, "
        "abort/drain or training-side cost",
    ),
)


@dataclass(frozen=True)
class SimSetup:
    steps: int = 20
    groups: int = 32  # K: groups consumed per step (at this engine count)
    n: int = 8
    over_sampling: float = 2.0
    max_tokens: int = 16384
    engines: int = 8
    prompt_len: int = 256
    seed: int = 0
    routing: str = "least_loaded"


@dataclass
class _Member:
    budget: int
    done: int = 0
    gen: list[tuple[int, int]] = field(default_factory=list)  # (tokens, step generated)
    engine: int | None = None  # where its last segment ran: its KV snapshot lives there

    @property
    def finished(self) -> bool:
        return self.done >= self.budget


@dataclass
class SimResult:
    mode: str
    engines: int = 1
    groups: int = 0  # K per step
    walls: list[float] = field(default_factory=list)
    consumed: list[int] = field(default_factory=list)
    offpolicy: int = 0
    recomputed: int = 0
    restored: int = 0
    busy_area: float = 0.0  # sum over engines of running-sequences x seconds
    generated: int = 0  # output tokens generated, all steps (consumed + buffered)
    buffered: int = 0  # output tokens of the groups left in the buffer after the last step
    resumes: int = 0  # segments that continued a partial sample (it had output tokens)
    resumes_restored: int = 0  # ... of which restored its KV snapshot (the rest re-prefilled)
    busy_max: float = 0.0  # sum over steps of the busiest engine's busy seconds
    busy_mean: float = 0.0  # sum over steps of the mean engine busy seconds

    @property
    def throughput(self) -> float:
        return sum(self.consumed) / sum(self.walls) if self.walls else 0.0

    @property
    def imbalance(self) -> float:
        """Busiest engine's busy time over the mean engine's, per step, totalled (1 = even)."""
        return self.busy_max / self.busy_mean if self.busy_mean else 1.0

    @property
    def restored_share(self) -> float | None:
        """Share of resumes that restored a snapshot (None: no resume)."""
        return self.resumes_restored / self.resumes if self.resumes else None


class _Engine:
    """One engine's timeline for a step: prefill, then decode with shrinking batch."""

    def __init__(self, rems: list[int], pre_s: float, cost: CostModel) -> None:
        self.cost, self.pre = cost, pre_s
        self.levels = sorted(set(rems))
        self.count = {r: rems.count(r) for r in self.levels}
        self.m = len(rems)
        self._phases = self._build()

    def _build(self) -> list[tuple[float, float, int, int, int]]:
        out, t, prev, alive = [], self.pre, 0, self.m
        for lvl in self.levels:
            dur = (lvl - prev) * self.cost.step_time(alive)
            out.append((t, t + dur, alive, prev, lvl))
            t, prev, alive = t + dur, lvl, alive - self.count[lvl]
        return out

    def phases(self) -> list[tuple[float, float, int, int, int]]:
        """(t0, t1, b, tokens_from, tokens_to) with common progress rising over the phase."""
        return self._phases

    @property
    def end(self) -> float:
        """When its last sequence finishes (the prefill's end when it has none)."""
        return self._phases[-1][1] if self._phases else self.pre

    def finish_time(self, rem: int) -> float:
        return next(t1 for _, t1, _, _, lvl in self._phases if lvl == rem)

    def progress_at(self, when: float) -> tuple[int, float]:
        """(tokens each unfinished sequence has by `when`, running-sequences x seconds)."""
        area = 0.0
        for t0, t1, b, p0, p1 in self._phases:
            if when <= t0:
                return p0, area
            if when < t1:
                frac = (when - t0) / (t1 - t0)
                return p0 + math.floor(frac * (p1 - p0)), area + b * (when - t0)
            area += b * (t1 - t0)
        return (self.levels[-1] if self.levels else 0), area


def _place(mode: str, setup: SimSetup, active: Sequence[_Member]) -> list[tuple[int, bool]]:
    """(engine, restores its snapshot there) for each sample of a step, in submission order."""
    slots = [Slot(dp_rank=e) for e in range(setup.engines)]
    running, need = [0] * setup.engines, [0.0] * setup.engines
    out = []
    for k, m in enumerate(active):
        held = m.engine if mode == "april-kv" and m.done else None
        if setup.routing == "round_robin":
            e = k % setup.engines
        else:
            loads = [SlotLoad(s, running[i], need[i]) for i, s in enumerate(slots)]
            e = plan_segment(loads, None if held is None else slots[held], True).slot.dp_rank
        running[e] += 1
        need[e] += kv_need(setup.prompt_len + m.done, m.budget - m.done)
        out.append((e, held == e))
    return out


def run_sim(mode: str, setup: SimSetup, cost: CostModel) -> SimResult:
    if setup.routing not in ROUTINGS:
        raise ValueError(f"routing {setup.routing!r}: one of {', '.join(ROUTINGS)}")
    wl = Workload("longtail", setup.n, setup.max_tokens, seed=setup.seed)
    res, next_idx = SimResult(mode, setup.engines, setup.groups), 0
    buffer: list[list[_Member]] = []
    want = (
        setup.groups
        if mode == "sync"
        else max(setup.groups, math.ceil(setup.over_sampling * setup.groups))
    )
    for step in range(setup.steps):
        fresh = want - len(buffer)
        groups = buffer + [
            [_Member(b) for b in wl.group(i).budgets] for i in range(next_idx, next_idx + fresh)
        ]
        next_idx += fresh
        active = [m for g in groups for m in g if not m.finished]
        per_engine: list[list[_Member]] = [[] for _ in range(setup.engines)]
        pre = [0.0] * setup.engines
        for m, (e, restore) in zip(active, _place(mode, setup, active), strict=True):
            per_engine[e].append(m)
            m.engine = e
            pre[e] += setup.prompt_len * cost.prefill_s
            if not m.done:
                continue
            res.resumes += 1
            if restore:
                pre[e] += m.done * cost.restore_s
                res.restored += m.done
                res.resumes_restored += 1
            else:
                pre[e] += m.done * cost.prefill_s
                res.recomputed += setup.prompt_len + m.done
        engines = [
            _Engine([m.budget - m.done for m in ms], pre[e], cost)
            for e, ms in enumerate(per_engine)
        ]
        done_at = [
            max(
                (
                    engines[m.engine].finish_time(m.budget - m.done)
                    for m in g
                    if not m.finished and m.engine is not None
                ),
                default=0.0,
            )
            for g in groups
        ]
        order = sorted(range(len(groups)), key=lambda i: (done_at[i], i))
        take = order[: setup.groups]
        wall = max(done_at[i] for i in take)
        busy = [min(wall, eng.end) for eng in engines]
        res.busy_max += max(busy)
        res.busy_mean += sum(busy) / len(busy)
        for e, ms in enumerate(per_engine):
            prog, area = engines[e].progress_at(wall)
            res.busy_area += area
            for m in ms:
                gained = min(m.budget - m.done, prog)
                m.done += gained
                m.gen.append((gained, step))
                res.generated += gained
        consumed = [groups[i] for i in take]
        res.walls.append(wall)
        res.consumed.append(sum(m.done for g in consumed for m in g))
        res.offpolicy += sum(t for g in consumed for m in g for t, s in m.gen if s < step)
        buffer = [groups[i] for i in order[setup.groups :]]
    res.buffered = sum(m.done for g in buffer for m in g)
    return res


def sweep(
    setup: SimSetup,
    cost: CostModel,
    modes: Sequence[str],
    engines: Sequence[int],
    groups_per_engine: int | None = None,
) -> list[SimResult]:
    """Every mode at every engine count, in that order. With `groups_per_engine`, K =
    groups_per_engine x E (weak scaling); without, `setup.groups` at every count (strong)."""
    out = []
    for e in engines:
        k = groups_per_engine * e if groups_per_engine is not None else setup.groups
        out += [run_sim(m, replace(setup, engines=e, groups=k), cost) for m in modes]
    return out


def calibrate(sync_steps: Sequence[StepRecord]) -> tuple[CostModel, str]:
    """Fit t(b) = a + c*b to measured sync steps: wall = a * iterations + c * tokens, where a
    sync step runs max_budget iterations and generates `tokens` sequence-iterations."""
    x = np.array([[s.max_budget, s.generated_tokens] for s in sync_steps], dtype=float)
    y = np.array([s.wall_s for s in sync_steps], dtype=float)
    if len(y) >= 2 and np.linalg.matrix_rank(x) == 2:
        (a, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    else:
        a, c = -1.0, -1.0
    if a <= 0 or c <= 0:  # fall back to one non-negative term
        a, c = max(0.0, float(y.sum() / x[:, 0].sum())), 0.0
    pred = x @ np.array([a, c])
    err = float(np.mean(np.abs(pred - y) / y)) if len(y) else 0.0
    cm = CostModel(
        "calibrated from this run's sync steps",
        a=float(a),
        c=float(c),
        prefill_s=float(c),
        restore_s=0.0,
        assumptions=(
            f"least-squares fit over {len(y)} sync steps, mean abs error {100 * err:.1f}%",
            "re-prefill costs c per token (the marginal cost of one more sequence-token)",
            "restore is free (no snapshots measured)",
        ),
    )
    return cm, f"a = {a * 1e3:.3f} ms/iteration, c = {c * 1e3:.4f} ms/sequence"


def report(
    setup: SimSetup,
    cost: CostModel,
    modes: Sequence[str],
    engines: Sequence[int] | None = None,
    groups_per_engine: int | None = None,
) -> str:
    """The cost model, the assumptions and one row per (engine count, mode); `engines`
    defaults to `setup.engines`, K per step as in `sweep`."""
    counts = list(engines) if engines else [setup.engines]
    lines = [
        "SIMULATION (a model, not a measurement)",
        f"cost model: {cost.name}",
        f"  t(b) = {cost.a * 1e3:.3f} ms + {cost.c * 1e3:.4f} ms x b per decode iteration; "
        f"prefill {cost.prefill_s * 1e6:.2f} us/token; restore {cost.restore_s * 1e6:.2f} "
        "us/token",
    ]
    lines += [f"  assumption: {a}" for a in cost.assumptions]
    if max(counts) > 1:
        lines.append(f"  assumption: placement {ROUTING_TEXT[setup.routing]}")
        lines += [f"  assumption: {a}" for a in PLACEMENT_ASSUMPTIONS]
    if groups_per_engine is not None:
        batch = (
            f"K = {groups_per_engine} groups per engine per step (weak scaling: "
            f"K = {groups_per_engine} x engines)"
        )
    elif len(counts) > 1:
        batch = f"K = {setup.groups} groups per step at every engine count (strong scaling)"
    else:
        batch = f"K = {setup.groups} groups per step"
    lines.append(
        f"setup: {','.join(map(str, counts))} engine(s), routing {setup.routing}; {batch}, "
        f"{setup.n} samples each; over-sampling {setup.over_sampling}, max {setup.max_tokens} "
        f"tokens (longtail), prompt {setup.prompt_len} tokens, {setup.steps} steps, seed "
        f"{setup.seed}"
    )
    results = sweep(setup, cost, modes, counts, groups_per_engine)
    lines.append(
        f"{'engines':>7} {'K':>5} {'mode':>9} {'s/step':>9} {'tok/s':>11} {'x sync':>7} "
        f"{'offpol %':>9} {'batch/eng':>9} {'imbal':>6} {'restore %':>9} "
        f"{'recomp tok':>11}"
    )
    base: dict[int, float] = {r.engines: r.throughput for r in results if r.mode == "sync"}
    for r in results:
        wall = sum(r.walls)
        ratio = f"{r.throughput / base[r.engines]:.2f}" if base.get(r.engines) else "n/a"
        share = r.restored_share
        restore = f"{100 * share:.1f}" if r.mode == "april-kv" and share is not None else "-"
        lines.append(
            f"{r.engines:>7} {r.groups:>5} {r.mode:>9} {wall / len(r.walls):>9.2f} "
            f"{r.throughput:>11.1f} {ratio:>7} "
            f"{100 * r.offpolicy / max(1, sum(r.consumed)):>9.1f} "
            f"{r.busy_area / wall / r.engines:>9.1f} {r.imbalance:>6.2f} {restore:>9} "
            f"{r.recomputed:>11}"
        )
    lines += [
        "  x sync: vs sync at the same engine count; batch/eng: mean running samples per engine",
        "  imbal: per step, the busiest engine's busy time / the mean engine's, totalled over "
        "steps (1.00 = even; an engine is busy from the step's start until its last sample ends "
        "or the step does)",
        "  restore %: april-kv resumes that restored their snapshot (the rest re-prefilled: "
        "placed off the engine holding it); recomp tok: prompt + partial tokens re-prefilled",
    ]
    return "\n".join(lines)
