"""april-bench's end-to-end figures, pure logic: how many versions old each consumed token is
(in the order the bench pushed them), the idle share over windows that span training, and
consumed tokens per second of the whole loop."""

from __future__ import annotations

import pytest

from april_bench.metrics import wall_throughput, windows_idle_frac
from april_bench.staleness import (
    UNKNOWN,
    describe,
    merge,
    offpolicy_tokens,
    sample_histogram,
    version_lag,
)


def test_version_lag_counts_in_push_order_then_integers() -> None:
    history = ["default", "bench-v1", "bench-v2", "bench-v3"]
    assert version_lag("bench-v3", "bench-v3", history) == 0
    assert version_lag("default", "bench-v2", history) == 2
    assert version_lag("bench-v1", "bench-v3", history) == 2
    # A later mode pushes the step numbers again: its latest push counts.
    again = ["5", "0", "1", "2"]
    assert version_lag("0", "2", again) == 2 and version_lag("5", "0", again) == 1
    assert version_lag("3", "7", []) == 4  # not pushed by the bench: integer order
    assert version_lag("other", "bench-v2", history) == UNKNOWN
    assert version_lag("9", "2", []) == UNKNOWN  # newer than the consumption version


def test_sample_histogram_weighs_each_segment_by_its_tokens() -> None:
    samples = [
        {
            "segments": [
                {"start": 0, "end": 4, "weight_version": "0"},
                {"start": 4, "end": 10, "weight_version": "2"},
            ]
        },
        {"segments": [{"start": 0, "end": 3, "weight_version": "1"}]},
        {"segments": []},
    ]
    hist = sample_histogram(samples, "2", ["0", "1", "2"])
    assert hist == {2: 4, 0: 6, 1: 3}
    assert offpolicy_tokens(hist) == 7
    assert merge([hist, {0: 1, UNKNOWN: 2}]) == {UNKNOWN: 2, 0: 7, 1: 3, 2: 4}
    assert describe({0: 3, 1: 1}) == "0: 3 (75.0%)  1: 1 (25.0%)"
    assert describe({UNKNOWN: 2}) == "?: 2 (100.0%)" and describe({}) == "no tokens"


def test_idle_share_spans_several_windows_and_holds_each_sample_until_the_next() -> None:
    # running: 4 from t=0, 0 from t=2 (training: nothing runs), 3 from t=5
    samples = [(0.0, 4), (2.0, 0), (5.0, 3)]
    assert windows_idle_frac(samples, [(0.0, 2.0)]) == 0.0
    assert windows_idle_frac(samples, [(0.0, 6.0)]) == pytest.approx(3 / 6)
    # Rollout 0-2 and training 2-5 as separate windows: the same 3 s idle of 5.
    assert windows_idle_frac(samples, [(0.0, 2.0), (2.0, 5.0)]) == pytest.approx(3 / 5)
    assert windows_idle_frac(samples, []) == 0.0


def test_wall_throughput_counts_training_time() -> None:
    assert wall_throughput(600, [1.0, 2.0]) == 200.0  # e.g. rollout 1 s + training 2 s
    assert wall_throughput(600, []) is None and wall_throughput(0, [0.0]) is None
