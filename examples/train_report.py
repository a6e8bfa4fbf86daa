"""Summary and plot of `out/train.jsonl` (pure: rows in, figures out)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WINDOW = 5  # steps: rewards are noisy per step, compare trailing means


@dataclass(frozen=True)
class ModeSummary:
    mode: str
    steps: int
    wall_s: float
    final_reward: float  # mean over the last WINDOW steps
    final_reward_sd: float  # their standard deviation
    reach_s: float | None  # first wall_s where the trailing mean reaches sync's final reward
    stale_share: float  # stale tokens / output tokens of the rows returned
    rollout_s: float = 0.0  # mean per step: waiting for the rollout call
    train_s: float = 0.0  # mean per step: the rest (loss, optimizer, weight push, prefetch)
    restarts: int = 0  # samples the server restarted from their prompt for max_staleness


def trailing_means(rewards: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(rewards[max(0, i + 1 - window) : i + 1]) for i in range(len(rewards))]


def summarize(rows: list[dict[str, Any]]) -> list[ModeSummary]:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by_mode = {
        m: sorted((r for r in rows if r["mode"] == m), key=lambda r: r["step"]) for m in modes
    }
    target = None
    if "sync" in by_mode and by_mode["sync"]:
        target = trailing_means([r["reward_mean"] for r in by_mode["sync"]])[-1]
    out = []
    for mode, rs in by_mode.items():
        if not rs:
            continue
        rewards = [r["reward_mean"] for r in rs]
        last = rewards[-WINDOW:]
        reach = None
        if target is not None:
            for r, m in zip(rs, trailing_means(rewards), strict=True):
                if m >= target and r["step"] >= WINDOW:
                    reach = float(r["wall_s"])
                    break
        # Tokens of the rows trained on (older rows only have the call's generated tokens).
        tokens = sum(r.get("returned_tokens", r.get("output_tokens", 0)) for r in rs)
        stale = sum(r.get("stale_tokens", 0) for r in rs)
        out.append(
            ModeSummary(
                mode,
                len(rs),
                float(rs[-1]["wall_s"]),
                statistics.fmean(last),
                statistics.pstdev(last),
                reach,
                stale / tokens if tokens else 0.0,
                statistics.fmean(float(r.get("rollout_s", 0.0)) for r in rs),
                statistics.fmean(float(r.get("train_s", 0.0)) for r in rs),
                int(rs[-1].get("staleness_restarts", 0)),  # the server's total (older rows: 0)
            )
        )
    return out


def table(summaries: list[ModeSummary]) -> str:
    head = (
        f"{'mode':<11} {'steps':>5} {'wall_s':>8} {'rollout s/step':>14} "
        f"{'train s/step':>12} {'final reward':>14} {'reaches sync final at':>22} "
        f"{'stale tokens':>12} {'restarts':>8}"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        reach = f"{s.reach_s:.1f} s" if s.reach_s is not None else "not reached"
        final = f"{s.final_reward:.3f}±{s.final_reward_sd:.3f}"
        lines.append(
            f"{s.mode:<11} {s.steps:>5} {s.wall_s:>8.1f} {s.rollout_s:>14.2f} "
            f"{s.train_s:>12.2f} {final:>14} {reach:>22} "
            f"{s.stale_share:>11.1%} {s.restarts:>8}"
        )
    return "\n".join(lines) + (
        f"\n(final reward: mean ± sd of the last {WINDOW} steps; a step = rollout s, waiting"
        " for the call, + train s, the rest: loss, optimizer, weight push, prefetch; restarts:"
        " samples the server restarted from their prompt to stay within max_staleness)"
    )


def split_table(rows: list[dict[str, Any]]) -> str:
    """Each step's split, rollout s / train s, one column per mode."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cell = {(r["mode"], r["step"]): r for r in rows}
    steps = sorted({r["step"] for r in rows})
    head = f"{'step':>4} " + " ".join(f"{m + ' roll/train s':>24}" for m in modes)
    lines = [head, "-" * len(head)]
    for step in steps:
        cells = []
        for m in modes:
            r = cell.get((m, step))
            text = (
                "" if r is None else f"{r.get('rollout_s', 0.0):.2f} / {r.get('train_s', 0.0):.2f}"
            )
            cells.append(f"{text:>24}")
        lines.append(f"{step:>4} " + " ".join(cells))
    return "\n".join(lines)


def by_seed(rows: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    """Rows per seed (rows without one count as one run)."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r.get("seed"), []).append(r)
    return out


def overlap_bound(sync: ModeSummary) -> float:
    """The most overlapping generation with training can gain on sync's step: (R + T) /
    max(R, T), from sync's own mean split (R: waiting for rollouts, T: the rest)."""
    longest = max(sync.rollout_s, sync.train_s)
    return (sync.rollout_s + sync.train_s) / longest if longest > 0 else 1.0


def seeds_table(rows: list[dict[str, Any]]) -> str:
    """Per seed and mode: wall seconds to reach that seed's sync final reward; the median over
    seeds; whether april-async got there before both others; sync's overlap bound beside the
    measured speed of a step (sync's mean step / april-async's)."""
    runs = {seed: {s.mode: s for s in summarize(rs)} for seed, rs in by_seed(rows).items()}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    head = f"{'seed':>5} " + " ".join(f"{m:>12}" for m in modes)
    head += f" {'async first':>11} {'bound':>6} {'step speed-up':>13}"
    lines = ["time to reach sync's final reward (wall s, training only)", head, "-" * len(head)]
    reach: dict[str, list[float]] = {m: [] for m in modes}
    firsts = 0
    for seed, summ in runs.items():
        cells = []
        for m in modes:
            r = summ[m].reach_s if m in summ else None
            reach[m].append(float("inf") if r is None else r)
            cells.append(f"{'not reached' if r is None else f'{r:.1f}':>12}")
        a = summ.get("april-async")
        others = [summ[m].reach_s for m in ("sync", "april") if m in summ]
        first = (
            a is not None
            and a.reach_s is not None
            and len(others) == 2
            and all(o is None or a.reach_s < o for o in others)
        )
        firsts += first
        bound = speed = "-"
        if "sync" in summ and a is not None:
            bound = f"{overlap_bound(summ['sync']):.2f}x"
            step_sync = summ["sync"].wall_s / summ["sync"].steps
            speed = f"{step_sync / (a.wall_s / a.steps):.2f}x"
        cells.append(f"{'yes' if first else 'no':>11} {bound:>6} {speed:>13}")
        lines.append(f"{seed!s:>5} " + " ".join(cells))
    med = []
    for m in modes:
        v = statistics.median(reach[m])
        med.append(f"{'not reached' if v == float('inf') else f'{v:.1f}':>12}")
    lines.append(f"{'med':>5} " + " ".join(med) + f" {f'{firsts}/{len(runs)}':>11}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors: dict[str, Any] = {}
    for mode, seed in dict.fromkeys((r["mode"], r.get("seed")) for r in rows):
        rs = sorted(
            (r for r in rows if r["mode"] == mode and r.get("seed") == seed),
            key=lambda r: r["step"],
        )
        xs = [r["wall_s"] for r in rs]
        ys = [r["reward_mean"] for r in rs]
        label = None if mode in colors else f"{mode} ({WINDOW}-step mean)"
        (line,) = ax.plot(xs, ys, alpha=0.2, color=colors.get(mode))
        colors.setdefault(mode, line.get_color())
        ax.plot(xs, trailing_means(ys), color=colors[mode], label=label)
    ax.set_xlabel("wall-clock seconds (training)")
    ax.set_ylabel("mean reward per step")
    ax.set_title("GRPO (TRL) on april-server: sync vs APRIL vs APRIL + background")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
