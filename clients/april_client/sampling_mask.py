"""Decode a sample's sampling mask (`Sample.sampling_mask`, docs/api.md, Sampling mask).

Row i holds the token ids the sampler kept when it drew `output_ids[i]` (ascending), and
`mask.logprobs[i]` that token's logprob over them, renormalised. Plain Python (no numpy):
`counts(mask)`, `offsets(mask)` (cumulative, from 0, one more than the rows), `rows(mask)`, and
`response_ids_and_offsets(sample)`, the same over `response_ids` with an empty span at every
appended token (the ragged layout of slime's `rollout_top_p_token_ids` / `_offsets`).
"""

from __future__ import annotations

import sys
from array import array
from itertools import accumulate

from .protocol import MaskDtype, Sample, SamplingMask
from .trainer_batch import over_response

_TYPECODES: dict[MaskDtype, str] = {"uint16": "H", "int32": "i"}


def decode(data: bytes, dtype: MaskDtype) -> list[int]:
    """Little-endian `dtype` values of `data`."""
    values = array(_TYPECODES[dtype])
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def counts(mask: SamplingMask) -> list[int]:
    """How many kept ids each row holds (0: no mask for that token)."""
    return decode(mask.counts, mask.dtype)


def offsets(mask: SamplingMask) -> list[int]:
    """Row i is `ids[offsets[i]:offsets[i + 1]]`; `len(rows) + 1` entries, the first 0."""
    return list(accumulate(counts(mask), initial=0))


def rows(mask: SamplingMask) -> list[list[int]]:
    """Each generated token's kept ids, ascending."""
    ids = decode(mask.ids, mask.dtype)
    bounds = offsets(mask)
    return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _checked(sample: Sample) -> SamplingMask:
    mask = sample.sampling_mask
    if mask is None:
        raise ValueError(f"sample {sample.sample_id!r} has no sampling mask (return_sampling_mask)")
    if mask.num_rows != len(sample.output_ids):
        raise ValueError(
            f"sample {sample.sample_id!r}: {mask.num_rows} mask rows for "
            f"{len(sample.output_ids)} output tokens"
        )
    return mask


def response_ids_and_offsets(sample: Sample) -> tuple[list[int], list[int]]:
    """The kept ids and offsets over `sample.response_ids` (output with the appended context at
    its places): generated token j's row is `ids[offsets[j]:offsets[j + 1]]`, an appended
    token's span is empty. `len(offsets) == len(response_ids) + 1`. Raises ValueError when the
    sample carries no mask."""
    mask = _checked(sample)
    spans = over_response(sample, counts(mask), 0)
    return decode(mask.ids, mask.dtype), list(accumulate(spans, initial=0))


def sampling_logprobs(sample: Sample) -> list[float]:
    """Per `response_ids` token, the behaviour policy's logprob: a generated token's logprob
    over its kept set (its `output_logprobs` entry where its row is empty), 0.0 on appended
    context. Raises ValueError when the sample carries no mask."""
    mask = _checked(sample)
    rows_lps = zip(mask.logprobs, counts(mask), sample.output_logprobs, strict=True)
    own = [kept if n else full for kept, n, full in rows_lps]
    return over_response(sample, own, 0.0)
