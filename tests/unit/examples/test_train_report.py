"""`make train-demo`'s summary (pure) and its task's rewards."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples import train_task
from examples.train_report import (
    WINDOW,
    overlap_bound,
    plot,
    seeds_table,
    split_table,
    summarize,
    table,
    trailing_means,
)


def rows(mode: str, rewards: list[float], step_s: float) -> list[dict[str, object]]:
    return [
        {
            "mode": mode,
            "step": i + 1,
            "wall_s": step_s * (i + 1),
            "reward_mean": r,
            "output_tokens": 100,
            "stale_tokens": 25 if mode == "april" else 0,
            "rollout_s": step_s * 0.75,
            "train_s": step_s * 0.25,
        }
        for i, r in enumerate(rewards)
    ]


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
    assert summary["sync"].rollout_s == 1.5 and summary["sync"].train_s == 0.5
    split = split_table(rows("sync", sync, 2.0) + rows("april", april, 1.0))
    assert "1.50 / 0.50" in split and "0.75 / 0.25" in split
    assert len(split.splitlines()) == 2 + len(sync)
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


def test_budgets_have_a_long_tail_and_leave_the_prompts_alone() -> None:
    rows_ = train_task.dataset(size=512, seed=0, max_budget=256)
    budgets = sorted(r[train_task.BUDGET_COLUMN] for r in rows_)
    assert budgets[0] >= train_task.BUDGET_MIN and budgets[-1] == 256
    median = budgets[len(budgets) // 2]
    assert median <= 48  # most answers are short...
    assert sum(b >= 8 * median for b in budgets) >= len(budgets) // 20  # ...a few very long
    prompts = [(r["prompt"], r["answer"]) for r in rows_]
    assert prompts == [(r["prompt"], r["answer"]) for r in train_task.dataset(512, 0, 64)]


def test_stale_share_counts_the_tokens_returned() -> None:
    """With background generation a call's own `output_tokens` leave out what was generated
    between calls; the share is over the returned rows' tokens when the rows carry them."""
    rs = rows("april", [0.1] * 6, 1.0)
    for r in rs:
        r["returned_tokens"] = 200
    assert summarize(rs)[0].stale_share == 0.125


def test_seeds_table_gives_each_seeds_reach_the_median_and_the_overlap_bound() -> None:
    """Three seeds x three modes: the time to each seed's own sync final reward, the median,
    how many seeds april-async got there before both others, sync's (R + T) / max(R, T)."""
    rise = [0.1 * i for i in range(10)]  # trailing mean reaches sync's final at step 10
    all_rows: list[dict[str, object]] = []
    for seed, async_step_s in [(0, 1.0), (1, 1.5), (2, 3.0)]:
        for mode, step_s in [("sync", 2.0), ("april", 1.8), ("april-async", async_step_s)]:
            for r in rows(mode, rise, step_s):
                r["seed"] = seed
                all_rows.append(r)
    text = seeds_table(all_rows)
    lines = text.splitlines()
    seed0 = next(ln for ln in lines if ln.split()[0] == "0")
    assert seed0.split()[1:4] == ["20.0", "18.0", "10.0"]  # sync, april, april-async
    assert seed0.split()[4] == "yes" and seed0.split()[5] == "1.33x"  # (1.5 + 0.5) / 1.5
    assert seed0.split()[6] == "2.00x"  # sync's 2.0 s steps vs april-async's 1.0 s
    seed2 = next(ln for ln in lines if ln.split()[0] == "2")
    assert seed2.split()[4] == "no"  # 30.0 s: after both
    med = next(ln for ln in lines if ln.split()[0] == "med")
    assert med.split()[1:5] == ["20.0", "18.0", "15.0", "2/3"]
    assert overlap_bound(summarize(rows("sync", rise, 2.0))[0]) == 2.0 / 1.5


def test_restarts_are_the_servers_running_total_at_the_last_step() -> None:
    rs = rows("april-async", [0.1] * 6, 1.0)
    for i, r in enumerate(rs):
        r["staleness_restarts"] = 3 * i
    (s,) = summarize(rs)
    assert s.restarts == 15
    assert table([s]).splitlines()[2].split()[-1] == "15"
    assert summarize(rows("sync", [0.1] * 6, 1.0))[0].restarts == 0  # rows from before: 0


@pytest.mark.parametrize("flags", [[], ["--same-wall"]])
def test_equal_wall_time_needs_sync_first(flags: list[str]) -> None:
    """Equal wall time (the default) gives the other modes sync's time: sync must run first."""
    from examples.train_demo import main

    with pytest.raises(SystemExit) as e:
        main([*flags, "--modes", "april,sync"])
    assert e.value.code == 2


def test_same_steps_and_same_wall_exclude_each_other() -> None:
    from examples.train_demo import main

    with pytest.raises(SystemExit) as e:
        main(["--same-steps", "--same-wall"])
    assert e.value.code == 2


def test_loss_type_is_cispo_by_default_and_dapo_on_request(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The demo runs every mode with the loss it names, with that loss's `epsilon_high`."""
    from examples import train_demo

    seen: list[train_demo.DemoConfig] = []
    monkeypatch.setattr(train_demo, "run_mode", lambda mode, cfg: seen.append(cfg) or [])
    monkeypatch.setattr(train_demo, "plot", lambda rows, path: None)
    for flags, want in (([], "cispo"), (["--loss-type", "dapo"], "dapo")):
        seen.clear()
        train_demo.main(
            [*flags, "--modes", "sync", "--same-steps", "--out", str(tmp_path / "t.jsonl")]
        )
        assert [c.loss_type for c in seen] == [want]
    assert train_demo.LOSS_TYPES == {"dapo": None, "cispo": 5.0}
    with pytest.raises(SystemExit) as e:
        train_demo.main(["--loss-type", "grpo"])
    assert e.value.code == 2
