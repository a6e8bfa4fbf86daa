"""Decoding a sampling mask for a trainer (`sampling_mask.py`): rows, offsets, slime's ragged
layout over `response_ids` and the behaviour logprobs, with tool answers in place."""

from __future__ import annotations

import pytest

from april_client import sampling_mask as decode
from april_client.protocol import Appended, Sample, SamplingMask

U16 = "uint16"


def packed(values: list[int], width: int = 2) -> bytes:
    return b"".join(v.to_bytes(width, "little") for v in values)


def sample(appended: list[Appended] | None = None) -> Sample:
    """Output [10, 11, 12]: 10 kept {3, 10}, 11 no row, 12 kept {12, 99, 70000 % 65536}."""
    mask = SamplingMask(U16, packed([3, 10, 12, 99, 4464]), packed([2, 0, 3]), [-0.2, 0.0, -1.5])
    return Sample(
        sample_id="g/0",
        group_id="g",
        index=0,
        status="completed",
        prompt_ids=[1],
        output_ids=[10, 11, 12],
        output_logprobs=[-0.9, -0.8, -2.0],
        segments=[],
        max_new_tokens=8,
        finish_reason="stop",
        appended=appended or [],
        return_sampling_mask=True,
        sampling_mask=mask,
    )


def test_rows_and_offsets() -> None:
    mask = sample().sampling_mask
    assert mask is not None
    assert decode.counts(mask) == [2, 0, 3]
    assert decode.offsets(mask) == [0, 2, 2, 5]
    assert decode.rows(mask) == [[3, 10], [], [12, 99, 4464]]
    wide = SamplingMask("int32", packed([70000, 5], 4), packed([2], 4), [-0.1])
    assert decode.rows(wide) == [[70000, 5]]


def test_response_layout_leaves_an_empty_span_at_every_appended_token() -> None:
    s = sample([Appended(at=1, ids=[50, 51])])
    ids, offsets = decode.response_ids_and_offsets(s)
    assert s.response_ids == [10, 50, 51, 11, 12]
    assert len(offsets) == len(s.response_ids) + 1
    assert offsets == [0, 2, 2, 2, 2, 5]  # tool tokens and the row-less 11: empty spans
    assert ids == [3, 10, 12, 99, 4464]


def test_behaviour_logprobs_are_over_the_kept_set_where_there_is_one() -> None:
    s = sample([Appended(at=1, ids=[50, 51])])
    # 10: over its kept set; tool tokens 0.0; 11 has no row: its full-vocabulary logprob.
    assert decode.sampling_logprobs(s) == [-0.2, 0.0, 0.0, -0.8, -1.5]


def test_a_sample_without_a_mask_or_with_other_rows_is_an_error() -> None:
    s = sample()
    s.sampling_mask = None
    with pytest.raises(ValueError, match="no sampling mask"):
        decode.response_ids_and_offsets(s)
    s = sample()
    s.output_ids.append(13)
    with pytest.raises(ValueError, match="3 mask rows for 4 output tokens"):
        decode.sampling_logprobs(s)
