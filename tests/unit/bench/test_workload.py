"""april-bench workloads are seeded, reproducible and have the reference length distribution."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from april_bench.workload import Workload, load_lengths, lognormal_params


def test_the_same_seed_gives_the_same_stream_whoever_asks() -> None:
    a = Workload("longtail", n=4, max_tokens=512, seed=7)
    b = Workload("longtail", n=4, max_tokens=512, seed=7)
    assert a.groups(0, 10) == b.groups(0, 10)
    # Order of requests does not matter: group i is a pure function of i.
    assert a.group(5) == b.groups(3, 4)[2]
    assert a.groups(0, 10) != Workload("longtail", n=4, max_tokens=512, seed=8).groups(0, 10)


def test_longtail_budgets_have_p50_015_max_and_p99_max() -> None:
    wl = Workload("longtail", n=8, max_tokens=1000, seed=0)
    budgets = np.array([b for g in wl.groups(0, 2000) for b in g.budgets])
    assert budgets.min() >= 1 and budgets.max() <= 1000
    assert 140 <= np.median(budgets) <= 160
    assert np.percentile(budgets, 98.5) < 1000 <= np.percentile(budgets, 99.5)


def test_lognormal_parameters() -> None:
    mu, sigma = lognormal_params(16384)
    assert np.exp(mu) == pytest.approx(0.15 * 16384)
    assert np.exp(mu + 2.326347874 * sigma) == pytest.approx(16384)


def test_prompts_are_valid_token_ids_and_members_carry_budgets() -> None:
    wl = Workload("longtail", n=3, max_tokens=64, seed=1, vocab_size=50)
    for g in wl.groups(0, 50):
        assert g.input_ids is not None and 16 <= len(g.input_ids) <= 64
        assert all(3 <= t < 50 for t in g.input_ids)
        assert g.member_params() == [{"max_new_tokens": b} for b in g.budgets]
        assert g.sampling_params(64, 1.0)["ignore_eos"] is True


def test_jsonl_lengths_fill_groups_in_order_and_cycle(tmp_path: Path) -> None:
    f = tmp_path / "lengths.jsonl"
    rows = [{"lengths": [5, 9]}, {"length": 700}, {"output_len": 3}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    wl = Workload("jsonl", n=2, max_tokens=512, lengths=load_lengths(f))
    assert [g.budgets for g in wl.groups(0, 3)] == [(5, 9), (512, 3), (5, 9)]


def test_bad_jsonl_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"tokens": 3}\n')
    with pytest.raises(ValueError, match="needs 'lengths'"):
        load_lengths(f)


def test_natural_workload_is_text_with_an_answer() -> None:
    g = Workload("natural", n=4, max_tokens=128, seed=3).group(0)
    assert g.text is not None and g.input_ids is None and g.answer is not None
    a, b = (int(x) for x in g.text.split("what is ")[1].split("?")[0].split(" + "))
    assert int(g.answer) == a + b
    assert g.member_params() is None and g.sampling_params(128, 1.0)["ignore_eos"] is False
