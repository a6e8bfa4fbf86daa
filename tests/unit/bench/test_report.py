"""The printed and written figures (`report.py`): each mode's fraction of the bound beside its
ratio to sync, the shares of generated tokens thrown away or left unconsumed, the wall by
cause and the gap, and the bound's own line."""

from __future__ import annotations

import pytest

from april_bench.bound import Bound, BoundLevel
from april_bench.metrics import ModeResult, StepRecord, run_rate
from april_bench.report import pool_line, records, summary_table
from april_bench.staleness_ceiling import staleness_ceiling


def mode(name: str, consumed: int, generated: int, wasted: int = 0) -> ModeResult:
    step = StepRecord(0, 2.0, 2.0, 8, consumed, generated)
    step.prefill_s, step.decode_s, step.prefill_tokens = 0.2, 1.6, 400
    step.decode_by_bucket = {16: [0.6, 100, 1600], 32: [1.0, 100, 3200]}
    r = ModeResult(mode=name, steps=[step])
    r.leftover_tokens = generated - consumed - wasted
    return r


def test_every_mode_gets_its_fraction_of_the_bound_and_its_gap() -> None:
    b = Bound(
        levels=[
            BoundLevel(16, 1.0, 2000, 15.5, 8.0, 100.0, 0.9, 0.0, True),
            BoundLevel(32, 1.0, 4000, 31.0, 8.0, 100.0, 0.9, 0.0, True),
        ]
    )
    recs = records([mode("sync", 4000, 4000), mode("april", 6000, 7000, wasted=350)], b.to_json())
    sync, april = recs
    assert sync["output_throughput_vs_bound"] == 0.5  # 2000 tok/s of 4000
    assert april["output_throughput_vs_bound"] == 0.75
    assert april["output_throughput_vs_sync"] == 1.5
    assert april["thrown_away_share"] == 0.05 and april["unconsumed_share"] == round(650 / 7000, 4)
    causes = april["wall_by_cause"]
    assert causes["full_batch_from"] == 23 and causes["decode_full_s"] == 1.0  # bucket 32 only
    assert abs(sum(april["gap_to_bound"].values()) - 1.0) < 1e-3
    table = summary_table(recs)
    assert "x bound" in table and "4000.0 tok/s at concurrency 32" in table
    assert "april wall by cause" in table and "april vs the bound: consumed 0.75" in table
    assert "staleness ceiling" not in table  # none computed for this run


def test_a_runs_staleness_ceiling_is_printed_under_the_bound() -> None:
    b = Bound(levels=[BoundLevel(c, 1.0, 125 * c, c, 8.0, 100.0, 0.9, 0.0, True) for c in (8, 16)])
    levels = b.to_json()["bound_levels"]
    ceiling = staleness_ceiling(levels, [100] * 64, quota_samples=32, max_staleness=1)
    assert ceiling is not None
    run = {**b.to_json(), "staleness_ceiling": ceiling.to_json()}
    recs = records([mode("sync", 4000, 4000), mode("april", 6000, 6000)], run)
    recs[0]["staleness_hist"], recs[1]["staleness_hist"] = {"0": 4000}, {"0": 3000, "2": 3000}
    table = summary_table(recs)
    assert "staleness ceiling (a push every step, every consumed token within max_staleness 1" in (
        table
    )
    sync, april = (round(2000 / ceiling.tok_s, 2), round(3000 / ceiling.tok_s, 2))
    assert [r["output_throughput_vs_ceiling"] for r in recs] == pytest.approx([sync, april], 0.01)
    assert f"consumed x the staleness ceiling: sync {sync:.2f}, april {april:.2f} (50% of its" in (
        table
    )


def test_without_a_bound_the_fractions_are_absent() -> None:
    recs = records([mode("sync", 4000, 4000)], {})
    assert recs[0]["output_throughput_vs_bound"] is None and recs[0]["gap_to_bound"] is None
    assert "vs the bound" not in summary_table(recs)


def test_the_pool_line_shows_the_plays_median_expectation_against_the_bound() -> None:
    rec = {
        "mode": "april@auto",
        "inflight_targets": [None, 32, 32],
        "extra_groups": [None, 4, 2],
        "groups_wanted": [16, 12, 10],
        "goodput_expected": [None, 5000.0, 7000.0, 6000.0],
        "goodput_sync": [None, 4000.0, 4100.0, 4200.0],
        "goodput_got": [3000.0, 9000.0, 4000.0, 6000.0],
    }
    line = pool_line(rec, 8000.0)
    assert "goodput expected -/5000/7000/6000 (median 0.75 of the bound)" in line
    assert "over the run" not in line
    run_line = pool_line({**rec, "goodput_got_run": run_rate([(20.0, 40.0), (3e5, 0.01)])})
    assert "got 3000/9000/4000/6000 (95 over the run)" in run_line  # (800 + 3000) / 40.01
    assert "of the bound" not in pool_line(rec, None)
    assert "of the bound" not in pool_line({**rec, "goodput_expected": [None, None]}, 8000.0)
