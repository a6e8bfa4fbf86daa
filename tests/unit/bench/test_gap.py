"""A mode's distance to the bound (`gap.py`): the shares of bound x wall sum to one, the wall
splits by cause, and the clock's bucket keys are read back."""

from __future__ import annotations

from typing import Any

import pytest

from april_bench.gap import (
    decode_buckets,
    gap_line,
    gap_to_bound,
    shares_of_generated,
    wall_by_cause,
    wall_line,
)


def totals(**over: Any) -> dict[str, Any]:
    tot: dict[str, Any] = {
        "rollout_wall_s": 10.0,
        "consumed_tokens": 30_000,
        "generated_tokens": 40_000,
        "generated_in_calls": 40_000,
        "tokens_wasted": 2_000,
        "leftover_tokens": 8_000,
        "engine_prefill_s": 1.0,
        "engine_prefill_tokens": 10_000,
        "recomputed_tokens": 7_500,
        "engine_decode_s": 7.0,
        "engine_decode_by_bucket": {
            "16": [2.0, 300, 5000],
            "64": [4.0, 400, 26000],
            "91": [1.0, 100, 9000],
        },
    }
    tot.update(over)
    return tot


def test_the_shares_of_bound_times_wall_sum_to_one() -> None:
    gap = gap_to_bound(totals(), bound_tok_s=5000.0)
    assert gap is not None
    assert gap["consumed"] == pytest.approx(30_000 / 50_000)
    assert gap["outside_forwards"] == pytest.approx(0.2)  # 10 - 1 - 7 of 10 s
    assert gap["prefill"] == pytest.approx(0.1)
    assert gap["decode_below_bound"] == pytest.approx((5000 * 7 - 40_000) / 50_000)
    assert gap["generated_not_consumed"] == pytest.approx(10_000 / 50_000)
    assert sum(gap.values()) == pytest.approx(1.0)
    assert "consumed 0.60" in gap_line("april", gap)


def test_no_gap_without_a_bound_or_the_engine_clock() -> None:
    assert gap_to_bound(totals(), None) is None
    assert gap_to_bound(totals(engine_decode_s=None), 5000.0) is None
    assert wall_by_cause(totals(engine_prefill_s=None), 64) is None


def test_the_wall_splits_at_the_full_batchs_bucket() -> None:
    causes = wall_by_cause(totals(), full_batch=70)  # 70 falls in the bucket from 64
    assert causes is not None
    assert causes["full_batch_from"] == 64
    assert causes["decode_full_s"] == pytest.approx(5.0)  # buckets 64 and 91
    assert causes["decode_tail_s"] == pytest.approx(2.0)
    assert causes["prefill_resumed_s"] == pytest.approx(0.75)  # 7.5k of 10k prefill tokens
    assert causes["prefill_new_s"] == pytest.approx(0.25)
    assert causes["outside_forwards_s"] == pytest.approx(2.0)
    parts = [v for k, v in causes.items() if k.endswith("_s")]
    assert sum(parts) == pytest.approx(10.0)
    assert "decode at full batch (>= 64) 5.00 (50%)" in wall_line("april", 10.0, causes)


def test_outside_forwards_split_into_the_engine_idle_and_scheduling() -> None:
    causes = wall_by_cause(totals(engine_idle_s=0.5), full_batch=64)
    assert causes is not None
    assert causes["engine_idle_s"] == 0.5 and causes["scheduling_s"] == pytest.approx(1.5)
    assert "[engine idle 0.50, scheduling 1.50]" in wall_line("april", 10.0, causes)
    assert "engine_idle_s" not in (wall_by_cause(totals(), 64) or {})  # an older server


def test_without_a_bound_no_decode_counts_as_full() -> None:
    causes = wall_by_cause(totals(), full_batch=None)
    assert causes is not None and causes["decode_full_s"] == 0.0
    assert causes["decode_tail_s"] == pytest.approx(7.0)


def test_thrown_away_and_unconsumed_are_shares_of_generated() -> None:
    assert shares_of_generated(totals()) == (0.05, 0.2)
    assert shares_of_generated(totals(generated_tokens=0)) == (None, None)


def test_bucket_keys_of_a_clock_delta_are_read_back() -> None:
    delta = {
        "decode_s": 3.0,
        "decode_s_b16": 1.0,
        "decode_batches_b16": 50.0,
        "decode_tokens_b16": 900.0,
        "decode_s_b91": 0.0,  # present in both readings, no step between them
        "decode_batches_b91": 0.0,
        "decode_tokens_b91": 0.0,
    }
    assert decode_buckets(delta) == {16: [1.0, 50.0, 900.0]}
