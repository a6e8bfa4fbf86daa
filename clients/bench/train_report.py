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
            )  # fmt: skip
        )
    return out


def table(summaries: list[ModeSummary]) -> str:
    head = (f"{'mode':<11} {'steps':>5} {'wall_s':>8} {'rollout s/step':>14} "
            f"{'train s/step':>12} {'final reward':>14} {'reaches sync final at':>22} "
            f"{'stale tokens':>12}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for s in summaries:
        reach = f"{s.reach_s:.1f} s" if s.reach_s is not None else "not reached"
        final = f"{s.final_reward:.3f}±{s.final_reward_sd:.3f}"
        lines.append(f"{s.mode:<11} {s.steps:>5} {s.wall_s:>8.1f} {s.rollout_s:>14.2f} "
                     f"{s.train_s:>12.2f} {final:>14} {reach:>22} "
                     f"{s.stale_share:>11.1%}")  # fmt: skip
    return "\n".join(lines) + (
        f"\n(final reward: mean ± sd of the last {WINDOW} steps; a step = rollout s, waiting"
        " for the call, + train s, the rest: loss, optimizer, weight push, prefetch)"
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


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["step"])
        xs = [r["wall_s"] for r in rs]
        ys = [r["reward_mean"] for r in rs]
        (line,) = ax.plot(xs, ys, alpha=0.3)
        ax.plot(
            xs, trailing_means(ys), color=line.get_color(), label=f"{mode} ({WINDOW}-step mean)"
        )
    ax.set_xlabel("wall-clock seconds (training)")
    ax.set_ylabel("mean reward per step")
    ax.set_title("GRPO (TRL) on april-server: sync vs APRIL vs APRIL + background")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
