"""Sampling masks across segments (rules/sampling_mask.py): rows follow the output tokens
through budgets, missing rows, a mask turned on or off mid-way, restarts, and engines of other
vocabularies; what SGLang would refuse is a 400 before anything runs."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from april_client import sampling_mask as decode
from april_client.protocol import GroupSpec, Sample, SamplingMask
from april_server.rules import samples
from april_server.rules import sampling_mask as mask_rules
from april_server.wire.errors import ApiError


def sample(budget: int = 100, mask: bool = True) -> Sample:
    spec = GroupSpec(group_id="g", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": budget})
    return samples.build_group(spec, [1, 2, 3], 4096, None, mask=mask).samples[0]


def row_of(token: int) -> list[int]:
    return [token, token + 1000, 7]


def segment(tokens: list[int], rows: mask_rules.MaskRows | None) -> samples.SegmentResult:
    return samples.SegmentResult(tokens, [-1.0] * len(tokens), "abort", "0", sampling_mask=rows)


def rows_for(tokens: list[int], dtype: str = "uint16") -> mask_rules.MaskRows:
    lps = [-0.5 - t / 100 for t in tokens]
    return mask_rules.encode([row_of(t) for t in tokens], lps, dtype)  # type: ignore[arg-type]


def test_encode_sorts_each_row_and_decodes_back() -> None:
    rows = mask_rules.encode([[5, 1, 3], [9], [70000 % 65536, 2]], [-0.1, 0.0, -2.0], "uint16")
    mask = SamplingMask(rows.dtype, rows.ids, rows.counts, rows.logprobs)
    assert decode.rows(mask) == [[1, 3, 5], [9], [2, 4464]]
    assert decode.counts(mask) == [3, 1, 2]
    assert decode.offsets(mask) == [0, 3, 4, 6]
    assert len(rows.ids) == 6 * 2 and len(rows.counts) == 3 * 2  # uint16: 2 bytes an id


def test_dtype_is_the_smallest_that_holds_ids_and_counts() -> None:
    assert mask_rules.dtype_for(448, 4096) == "uint16"
    assert mask_rules.dtype_for(65536, 4096) == "uint16"
    assert mask_rules.dtype_for(151936, 4096) == "int32"
    assert mask_rules.dtype_for(448, 70000) == "int32"
    assert mask_rules.dtype_for(None, 4096) == "int32"


@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(1, 40))
def test_rows_follow_the_tokens_across_segments_and_the_budget(
    cuts: list[int], budget: int
) -> None:
    """However the output is cut into segments (and the last cut by the budget), the rows are
    one per kept token, each the row of its token, as if it were one segment."""
    s = sample(budget)
    token = 0
    for n in cuts:
        tokens = list(range(token, token + n))
        token += n
        samples.apply_segment(s, segment(tokens, rows_for(tokens)), "recomputed")
        if samples.remaining_budget(s) <= 0:
            break
    mask = s.sampling_mask
    assert mask is not None and mask.num_rows == len(s.output_ids) <= budget
    assert decode.rows(mask) == [sorted(row_of(t)) for t in s.output_ids]
    assert mask.logprobs == [-0.5 - t / 100 for t in s.output_ids]


def test_a_segment_without_rows_gets_empty_rows() -> None:
    s = sample()
    samples.apply_segment(s, segment([1, 2], rows_for([1, 2])), "fresh")
    samples.apply_segment(s, segment([3, 4, 5], None), "recomputed")  # the engine sent none
    short = mask_rules.encode([row_of(6)], [-0.2], "uint16")  # one row for two tokens
    samples.apply_segment(s, segment([6, 7], short), "recomputed")
    mask = s.sampling_mask
    assert mask is not None
    assert decode.counts(mask) == [3, 3, 0, 0, 0, 3, 0]
    assert mask.logprobs[2:5] == [0.0] * 3 and mask.logprobs[5] == -0.2


def test_not_asked_records_nothing() -> None:
    s = sample(mask=False)
    samples.apply_segment(s, segment([1, 2], rows_for([1, 2])), "fresh")
    assert s.sampling_mask is None


def test_turned_on_mid_way_gives_earlier_tokens_empty_rows_and_off_drops_the_record() -> None:
    s = sample(mask=False)
    samples.apply_segment(s, segment([1, 2], None), "fresh")
    mask_rules.switch(s, True)
    samples.apply_segment(s, segment([3], rows_for([3])), "recomputed")
    mask = s.sampling_mask
    assert mask is not None and decode.counts(mask) == [0, 0, 3]
    assert decode.rows(mask)[2] == sorted(row_of(3))
    mask_rules.switch(s, False)
    assert s.sampling_mask is None and not s.return_sampling_mask
    samples.apply_segment(s, segment([4], None), "recomputed")
    assert s.sampling_mask is None


def test_a_restart_forgets_the_rows_but_keeps_the_setting() -> None:
    s = sample()
    samples.apply_segment(s, segment([1, 2], rows_for([1, 2])), "fresh")
    samples.restart_for_staleness(s)
    assert s.sampling_mask is None and s.return_sampling_mask
    samples.apply_segment(s, segment([9], rows_for([9])), "fresh")
    assert s.sampling_mask is not None and decode.rows(s.sampling_mask) == [sorted(row_of(9))]


def test_rows_of_a_wider_vocabulary_widen_the_record() -> None:
    s = sample()
    samples.apply_segment(s, segment([1], rows_for([1])), "fresh")
    samples.apply_segment(s, segment([2], rows_for([2], "int32")), "recomputed")
    mask = s.sampling_mask
    assert mask is not None and mask.dtype == "int32"
    assert decode.rows(mask) == [sorted(row_of(1)), sorted(row_of(2))]


def test_the_record_survives_the_store_encoding() -> None:
    s = sample()
    samples.apply_segment(s, segment([1, 2], rows_for([1, 2])), "fresh")
    for codec in (msgspec.msgpack, msgspec.json):
        back = codec.decode(codec.encode(s), type=Sample)
        assert back.sampling_mask == s.sampling_mask


@pytest.mark.parametrize(
    ("params", "ok"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "top_p": 0.5}, True),  # greedy: SGLang makes its top_k 1
        ({"temperature": 1.0, "top_k": 20}, True),
        ({"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.1}, True),
        ({"top_k": 4096}, True),
        ({"top_k": 4097}, False),
        ({"temperature": 1.0}, False),
        ({"temperature": 1.0, "top_p": 0.9}, False),
        ({"top_k": -1, "top_p": 0.9}, False),
        ({"top_k": True}, False),
    ],
)
def test_params_without_a_bounded_top_k_are_refused(params: dict[str, object], ok: bool) -> None:
    if ok:
        mask_rules.check_params(params, 4096, "g")
        return
    with pytest.raises(ApiError) as e:
        mask_rules.check_params(params, 4096, "g")
    assert (e.value.status, e.value.code) == (400, "invalid_sampling_params")


def test_an_engine_without_masks_refuses_them() -> None:
    with pytest.raises(ApiError) as e:
        mask_rules.check_params({"temperature": 0.0}, None, "g")
    assert e.value.code == "sampling_mask_unavailable"


def test_a_group_setting_overrides_the_calls() -> None:
    on = GroupSpec(group_id="a", input_ids=[1], return_sampling_mask=True)
    off = msgspec.structs.replace(on, return_sampling_mask=False)
    unset = msgspec.structs.replace(on, return_sampling_mask=None)
    assert samples.build_group(on, [1], 4096, None, mask=False).samples[0].return_sampling_mask
    assert not samples.build_group(off, [1], 4096, None, mask=True).samples[0].return_sampling_mask
    assert samples.build_group(unset, [1], 4096, None, mask=True).samples[0].return_sampling_mask
