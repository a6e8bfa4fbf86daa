"""`--simulate`: a discrete-event model of the same RL loop. It is a SIMULATION, not a
measurement: every figure it prints follows from the cost model and assumptions it prints.

Model: E identical engines; continuous batching; a request is routed round-robin when its step
starts. An engine first prefills what it was given (prompt tokens x `prefill_s`, plus for a
resumed sample its partial tokens re-prefilled (`april`) or restored (`april-kv`,
`restore_s` per token)), then decodes: every running sequence gains one token per iteration, and
an iteration with b sequences takes t(b) = a + c x b seconds. Between completions b is constant,
so the timeline is exact. The same workload stream and group accounting as the real driver:
sync waits for K whole groups; APRIL keeps ceil(over_sampling x K) groups in flight, takes the
first K to finish, aborts the rest at that instant and buffers their partial tokens. A weight
update happens between steps, so a token consumed at a later step than it was generated is
off-policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .metrics import StepRecord
from .workload import Workload


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
    "8xH200, 8B dense model (bf16), one engine per GPU (assumed constants, not measured)",
    a=6e-3, c=2e-4, prefill_s=4e-5, restore_s=2.6e-6,
    assumptions=(
        "a = 6 ms: 16 GB of weights read per iteration at ~3.4 TB/s effective HBM bandwidth "
        "plus ~1.5 ms scheduling/launch overhead (CUDA graphs)",
        "c = 0.2 ms per running sequence: ~4k-token average context x 128 KiB/token KV read at "
        "~3.4 TB/s, plus its share of compute; c does not grow with context length here",
        "prefill 40 us/token: 2 x 8e9 FLOP per token at ~400 TFLOP/s effective",
        "restore 2.6 us/token: 128 KiB/token over PCIe Gen5 at ~50 GB/s",
        "no KV-capacity limit, retraction, chunked-prefill overlap or router imbalance; no "
        "request submission, abort/drain or training-side cost",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class SimSetup:
    steps: int = 20
    groups: int = 32
    n: int = 8
    over_sampling: float = 2.0
    max_tokens: int = 16384
    engines: int = 8
    prompt_len: int = 256
    seed: int = 0


@dataclass
class _Member:
    budget: int
    done: int = 0
    gen: list[tuple[int, int]] = field(default_factory=list)  # (tokens, step generated)

    @property
    def finished(self) -> bool:
        return self.done >= self.budget


@dataclass
class SimResult:
    mode: str
    walls: list[float] = field(default_factory=list)
    consumed: list[int] = field(default_factory=list)
    offpolicy: int = 0
    recomputed: int = 0
    restored: int = 0
    busy_area: float = 0.0  # sum over engines of running-sequences x seconds

    @property
    def throughput(self) -> float:
        return sum(self.consumed) / sum(self.walls) if self.walls else 0.0


class _Engine:
    """One engine's timeline for a step: prefill, then decode with shrinking batch."""

    def __init__(self, rems: list[int], pre_s: float, cost: CostModel) -> None:
        self.cost, self.pre = cost, pre_s
        self.levels = sorted(set(rems))
        self.count = {r: rems.count(r) for r in self.levels}
        self.m = len(rems)

    def phases(self) -> list[tuple[float, float, int, int, int]]:
        """(t0, t1, b, tokens_from, tokens_to) with common progress rising over the phase."""
        out, t, prev, alive = [], self.pre, 0, self.m
        for lvl in self.levels:
            dur = (lvl - prev) * self.cost.step_time(alive)
            out.append((t, t + dur, alive, prev, lvl))
            t, prev, alive = t + dur, lvl, alive - self.count[lvl]
        return out

    def finish_time(self, rem: int) -> float:
        return next(t1 for _, t1, _, _, lvl in self.phases() if lvl == rem)

    def progress_at(self, when: float) -> tuple[int, float]:
        """(tokens each unfinished sequence has by `when`, running-sequences x seconds)."""
        area = 0.0
        for t0, t1, b, p0, p1 in self.phases():
            if when <= t0:
                return p0, area
            if when < t1:
                frac = (when - t0) / (t1 - t0)
                return p0 + math.floor(frac * (p1 - p0)), area + b * (when - t0)
            area += b * (t1 - t0)
        return (self.levels[-1] if self.levels else 0), area


def run_sim(mode: str, setup: SimSetup, cost: CostModel) -> SimResult:
    wl = Workload("longtail", setup.n, setup.max_tokens, seed=setup.seed)
    res, next_idx = SimResult(mode), 0
    buffer: list[list[_Member]] = []
    want = (
        setup.groups
        if mode == "sync"
        else max(setup.groups, math.ceil(setup.over_sampling * setup.groups))
    )
    for step in range(setup.steps):
        fresh = want - len(buffer)
        groups = buffer + [[_Member(b) for b in wl.group(i).budgets]
                           for i in range(next_idx, next_idx + fresh)]  # fmt: skip
        next_idx += fresh
        active = [(gi, m) for gi, g in enumerate(groups) for m in g if not m.finished]
        per_engine: list[list[_Member]] = [[] for _ in range(setup.engines)]
        pre = [0.0] * setup.engines
        for k, (_, m) in enumerate(active):
            e = k % setup.engines
            per_engine[e].append(m)
            pre[e] += setup.prompt_len * cost.prefill_s
            if m.done and mode == "april-kv":
                pre[e] += m.done * cost.restore_s
                res.restored += m.done
            elif m.done:
                pre[e] += m.done * cost.prefill_s
                res.recomputed += setup.prompt_len + m.done
        engines = [_Engine([m.budget - m.done for m in ms], pre[e], cost)
                   for e, ms in enumerate(per_engine)]  # fmt: skip
        where = {id(m): e for e, ms in enumerate(per_engine) for m in ms}
        done_at = [max((engines[where[id(m)]].finish_time(m.budget - m.done)
                        for m in g if not m.finished), default=0.0) for g in groups]  # fmt: skip
        order = sorted(range(len(groups)), key=lambda i: (done_at[i], i))
        take = order[: setup.groups]
        wall = max(done_at[i] for i in take)
        for e, ms in enumerate(per_engine):
            prog, area = engines[e].progress_at(wall)
            res.busy_area += area
            for m in ms:
                gained = min(m.budget - m.done, prog)
                m.done += gained
                m.gen.append((gained, step))
        consumed = [groups[i] for i in take]
        res.walls.append(wall)
        res.consumed.append(sum(m.done for g in consumed for m in g))
        res.offpolicy += sum(t for g in consumed for m in g for t, s in m.gen if s < step)
        buffer = [groups[i] for i in order[setup.groups :]]
    return res


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
        "calibrated from this run's sync steps", a=float(a), c=float(c), prefill_s=float(c),
        restore_s=0.0,
        assumptions=(f"least-squares fit over {len(y)} sync steps, mean abs error {100 * err:.1f}%",
                     "re-prefill costs c per token (the marginal cost of one more sequence-token)",
                     "restore is free (no snapshots measured)"),
    )  # fmt: skip
    return cm, f"a = {a * 1e3:.3f} ms/iteration, c = {c * 1e3:.4f} ms/sequence"


def report(setup: SimSetup, cost: CostModel, modes: Sequence[str]) -> str:
    lines = ["SIMULATION (a model, not a measurement)", f"cost model: {cost.name}",
             f"  t(b) = {cost.a * 1e3:.3f} ms + {cost.c * 1e3:.4f} ms x b per decode iteration; "
             f"prefill {cost.prefill_s * 1e6:.2f} us/token; restore {cost.restore_s * 1e6:.2f} "
             "us/token"]  # fmt: skip
    lines += [f"  assumption: {a}" for a in cost.assumptions]
    lines.append(
        f"setup: {setup.engines} engine(s), {setup.groups} groups x {setup.n} per step, "
        f"over-sampling {setup.over_sampling}, max {setup.max_tokens} tokens (longtail), prompt "
        f"{setup.prompt_len} tokens, {setup.steps} steps, seed {setup.seed}"
    )
    results = [run_sim(m, setup, cost) for m in modes]
    base = results[0].throughput if results and results[0].mode == "sync" else 0.0
    lines.append(f"{'mode':>9} {'s/step':>9} {'tok/s':>11} {'x sync':>7} {'offpol %':>9} "
                 f"{'batch/eng':>9} {'recomp tok':>11}")  # fmt: skip
    for r in results:
        wall = sum(r.walls)
        ratio = f"{r.throughput / base:.2f}" if base else "n/a"
        lines.append(
            f"{r.mode:>9} {wall / len(r.walls):>9.2f} {r.throughput:>11.1f} {ratio:>7} "
            f"{100 * r.offpolicy / max(1, sum(r.consumed)):>9.1f} "
            f"{r.busy_area / wall / setup.engines:>9.1f} {r.recomputed:>11}"
        )
    return "\n".join(lines)
