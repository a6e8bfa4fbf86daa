"""The trainer-neutral rollout bookkeeping (`april_client.trainer_batch`): no trainer, no server."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from april_client.protocol import Group, Sample, Segment
from april_client.trainer_batch import (
    Ledger,
    extra_groups,
    fresh_mask,
    rows_from_groups,
    stale_tokens,
    unique_prompts,
)


def sample(gid: str, index: int, cuts: list[tuple[int, str]], status: str = "completed") -> Sample:
    """A sample whose output is split into segments ending at `cuts` [(end, version), ...]."""
    segs, start = [], 0
    for end, version in cuts:
        segs.append(Segment(start=start, end=end, weight_version=version, kv="fresh"))
        start = end
    return Sample(
        sample_id=f"{gid}/{index}",
        group_id=gid,
        index=index,
        status=status,  # type: ignore[arg-type]
        prompt_ids=[7, index],
        output_ids=list(range(100, 100 + start)),
        output_logprobs=[-0.5] * start,
        segments=segs,
        max_new_tokens=64,
        finish_reason="stop",
    )


@given(
    target=st.integers(1, 64),
    factor=st.floats(1.0, 4.0),
    buffered=st.integers(0, 300),
)
def test_extra_groups_keeps_the_buffer_bounded(target: int, factor: float, buffered: int) -> None:
    extra = extra_groups(target, factor, buffered)
    assert extra >= 0
    # A call sends target + extra and returns target: the buffer grows by `extra` at most, and
    # only while it is below the over-provisioning allowance.
    allowance = math.ceil(factor * target - 1e-9) - target
    assert buffered + extra == max(buffered, allowance)
    if factor == 1.0:
        assert extra == 0


def test_extra_groups_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="over_provision"):
        extra_groups(4, 0.5, 0)
    with pytest.raises(ValueError, match="target"):
        extra_groups(0, 2.0, 0)
    assert extra_groups(8, 2.0, 0) == 8
    assert extra_groups(8, 2.0, 5) == 3
    assert extra_groups(8, 2.0, 20) == 0


def test_unique_prompts_reads_the_repeat_sampler_order() -> None:
    assert unique_prompts(["a", "a", "b", "b"], 2) == ["a", "b"]
    msgs = [{"role": "user", "content": "hi"}]
    assert unique_prompts([msgs, msgs], 2) == [msgs]
    with pytest.raises(ValueError, match="contiguously"):
        unique_prompts(["a", "b", "a", "b"], 2)
    with pytest.raises(ValueError, match="groups of 3"):
        unique_prompts(["a", "a"], 3)


def test_fresh_mask_marks_only_the_current_version() -> None:
    s = sample("g", 0, [(3, "4"), (5, "5"), (9, "6")])
    assert fresh_mask(s, "6") == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert fresh_mask(s, "5") == [0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert stale_tokens(s, "6") == 5
    assert fresh_mask(sample("g", 0, []), "6") == []


def test_rows_are_contiguous_groups_in_server_order_with_their_own_metadata() -> None:
    a = Group(
        group_id="a",
        samples=[sample("a", 1, [(2, "1"), (4, "2")]), sample("a", 0, [(3, "2")])],
        metadata={"answer": "7", "k": 1},
    )
    b = Group(
        group_id="b",
        samples=[sample("b", 0, [(1, "2")]), sample("b", 1, [(2, "2")])],
        metadata={"answer": "3"},
    )
    rows = rows_from_groups([b, a], 2, "2", "mask")
    assert rows.group_ids == ["b", "b", "a", "a"]
    assert rows.prompt_ids == [[7, 0], [7, 1], [7, 0], [7, 1]]  # members in index order
    assert [m["answer"] for m in rows.metadata] == ["3", "3", "7", "7"]
    assert rows.statuses == ["completed"] * 4
    assert rows.columns() == ["answer"]  # only keys every row has
    assert rows.env_mask[3] == [0, 0, 1, 1]
    assert rows.stale_tokens == 2
    kept = rows_from_groups([b, a], 2, "2", "keep")
    assert kept.env_mask[3] == [1, 1, 1, 1] and kept.stale_tokens == 2
    assert all(len(lp) == len(c) for lp, c in zip(kept.logprobs, kept.completion_ids, strict=True))


def test_rows_refuse_partial_or_short_groups() -> None:
    with pytest.raises(ValueError, match="unfinished"):
        rows_from_groups(
            [Group(group_id="p", samples=[sample("p", 0, [(1, "1")], "partial")])], 1, "1", "mask"
        )
    with pytest.raises(ValueError, match="not 2"):
        rows_from_groups(
            [Group(group_id="s", samples=[sample("s", 0, [(1, "1")])])], 2, "1", "mask"
        )


def test_ledger_catches_loss_and_duplicates() -> None:
    ledger = Ledger()
    ledger.on_sent(["a", "b", "c"], 0)
    ledger.on_returned(["b"], 0)
    assert ledger.outstanding() == ["a", "c"]
    with pytest.raises(ValueError, match="twice"):
        ledger.on_returned(["b"], 1)
    with pytest.raises(ValueError, match="never sent"):
        ledger.on_returned(["z"], 1)
    with pytest.raises(ValueError, match="sent twice"):
        ledger.on_sent(["a"], 1)
    ledger.cleared.add("c")
    assert ledger.outstanding() == ["a"]
