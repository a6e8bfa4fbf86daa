"""`make train-demo`'s summary (pure) and its task's rewards."""

from __future__ import annotations

from pathlib import Path

from april_client.bench import train_task
from april_client.bench.train_report import WINDOW, plot, summarize, table, trailing_means


def rows(mode: str, rewards: list[float], step_s: float) -> list[dict[str, object]]:
    return [
        {"mode": mode, "step": i + 1, "wall_s": step_s * (i + 1), "reward_mean": r,
         "output_tokens": 100, "stale_tokens": 25 if mode == "april" else 0}
        for i, r in enumerate(rewards)
    ]  # fmt: skip


def test_trailing_means() -> None:
    assert trailing_means([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_summary_finds_when_april_reaches_the_sync_final_reward(tmp_path: Path) -> None:
    sync = [0.1 * i for i in range(10)]  # final trailing mean 0.7
    april = [0.1 * i for i in range(10)]
    summary = {s.mode: s for s in summarize(rows("sync", sync, 2.0) + rows("april", april, 1.0))}
    assert abs(summary["sync"].final_reward - sum(sync[-WINDOW:]) / WINDOW) < 1e-12
    assert summary["sync"].reach_s == 20.0  # only at its own last step
    assert summary["april"].reach_s == 10.0  # same curve, twice as fast per step
    assert summary["april"].stale_share == 0.25
    text = table(list(summary.values()))
    assert "10.0 s" in text and "25.0%" in text
    plot(rows("sync", sync, 2.0), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_summary_says_when_the_target_is_never_reached() -> None:
    out = summarize(rows("sync", [0.5] * 6, 1.0) + rows("april", [0.1] * 6, 1.0))
    assert out[1].reach_s is None
    assert "not reached" in table(out)


def test_rewards_check_the_rows_answer() -> None:
    assert train_task.digit_format(["12ab", "abcd"]) == [2 / 16, 0.0]
    assert train_task.digit_match(["x7 3", "3 7", "none"], answer=["7", "7", "7"]) == [
        1.0,
        0.0,
        0.0,
    ]
    rows_ = train_task.dataset(size=20, seed=1)
    assert all(f"digit {r['answer']}." in r["prompt"] for r in rows_)
    assert rows_ == train_task.dataset(size=20, seed=1)
