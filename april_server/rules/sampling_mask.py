"""Sampling masks across segments: pure rules over a sample's kept sets (no I/O, no torch).

A sample that asks (`return_sampling_mask`) holds one row per generated token: the ids the
sampler kept after top-k / top-p / min-p, and the token's logprob over them, renormalised
(docs/api.md, Sampling mask). A row is recorded when its token is sampled and never replaced:
neither a KV restore nor a re-prefill samples an earlier token again, so, unlike routing, no
position is ever computed twice. Rows follow `output_ids` (appended context has none), are
cut with the tokens a budget cuts, and are forgotten with the output (drop, staleness
restart). A token generated while the sample did not ask gets an empty row (count 0), so that
a sample that asks always has exactly one row per output token.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from april_client.protocol import MaskDtype, Sample, SamplingMask
from april_server.wire.errors import bad_request

_TYPECODES: dict[MaskDtype, str] = {"uint16": "H", "int32": "i"}
# SGLang's sampling params: a temperature below this is greedy (its top_k becomes 1); a top_k
# of -1 (or none) keeps the whole vocabulary.
GREEDY_BELOW = 1e-6


@dataclass(frozen=True, slots=True)
class MaskRows:
    """What an engine returned for one segment: one row per generated token, in order."""

    dtype: MaskDtype
    ids: bytes  # every row's kept ids, row after row, ascending within a row, little-endian
    counts: bytes  # ids per row, `dtype`
    logprobs: list[float]  # per row: the token's logprob over its row, renormalised


def dtype_for(vocab_size: int | None, max_kept: int) -> MaskDtype:
    """The smallest dtype that holds every token id and every row's count."""
    if vocab_size is not None and vocab_size <= 0x10000 and max_kept <= 0xFFFF:
        return "uint16"
    return "int32"


def _pack(values: Sequence[int], dtype: MaskDtype) -> bytes:
    out = array(_TYPECODES[dtype], values)
    if sys.byteorder == "big":
        out.byteswap()
    return out.tobytes()


def _unpack(data: bytes, dtype: MaskDtype) -> list[int]:
    out = array(_TYPECODES[dtype])
    out.frombytes(data)
    if sys.byteorder == "big":
        out.byteswap()
    return out.tolist()


def encode(rows: Sequence[Sequence[int]], logprobs: Sequence[float], dtype: MaskDtype) -> MaskRows:
    """Rows as the engine gave them (any order within a row) in the stored form. Logprobs past
    the rows are ignored, rows past the logprobs get 0.0."""
    ids: list[int] = []
    for row in rows:
        ids += sorted(row)
    lps = [float(x) for x in logprobs[: len(rows)]]
    lps += [0.0] * (len(rows) - len(lps))
    return MaskRows(dtype, _pack(ids, dtype), _pack([len(r) for r in rows], dtype), lps)


def check_wanted(wanted: bool, available: int | None, where: str) -> None:
    """400 when masks are asked of an engine that returns none (`available`: its bound)."""
    if wanted and available is None:
        raise bad_request(
            "sampling_mask_unavailable",
            f"{where}: return_sampling_mask needs an engine that returns sampling masks",
        )


def check_params(params: dict[str, Any], max_tokens: int | None, where: str) -> None:
    """400 unless SGLang would give these params a mask: greedy, or a finite top_k within the
    engine's bound (`--sampling-mask-max-tokens`), which bounds the size of a row."""
    check_wanted(True, max_tokens, where)
    assert max_tokens is not None
    temperature = params.get("temperature", 1.0)
    if isinstance(temperature, (int, float)) and 0 <= temperature < GREEDY_BELOW:
        return
    top_k = params.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= max_tokens:
        return
    raise bad_request(
        "invalid_sampling_params",
        f"{where}: return_sampling_mask needs greedy sampling (temperature 0) or a top_k from "
        f"1 to {max_tokens} (SGLang's --sampling-mask-max-tokens), got top_k={top_k!r}; for "
        "top-p alone, top_k = the vocabulary size keeps the same distribution",
    )


def record(sample: Sample, rows: MaskRows | None, new_tokens: int) -> None:
    """Record the rows of a segment that added `new_tokens` output tokens (already appended to
    `output_ids`; a budget may have cut some of what the engine returned). Missing rows (the
    engine returned none, or fewer) are empty. Mutates `sample`."""
    if not sample.return_sampling_mask:
        return
    before = len(sample.output_ids) - new_tokens
    mask = sample.sampling_mask
    if mask is None:  # the first rows, or turned on after tokens were generated
        dtype: MaskDtype = rows.dtype if rows is not None else "uint16"
        mask = sample.sampling_mask = SamplingMask(dtype, b"", b"", [])
    _extend_empty(mask, before - mask.num_rows)
    if rows is not None and new_tokens > 0:
        kept = rows
        if rows.dtype != mask.dtype:  # engines of an owner with other vocabularies: widen
            kept = _as_dtype(rows, "int32")
            _widen(mask)
        per_row = _unpack(kept.counts, kept.dtype)[:new_tokens]
        width = 2 if kept.dtype == "uint16" else 4
        mask.ids += kept.ids[: sum(per_row) * width]
        mask.counts += _pack(per_row, mask.dtype)
        mask.logprobs += kept.logprobs[: len(per_row)]
    _extend_empty(mask, len(sample.output_ids) - mask.num_rows)


def _extend_empty(mask: SamplingMask, n: int) -> None:
    if n > 0:
        mask.counts += _pack([0] * n, mask.dtype)
        mask.logprobs += [0.0] * n


def _as_dtype(rows: MaskRows, dtype: MaskDtype) -> MaskRows:
    ids, counts = _unpack(rows.ids, rows.dtype), _unpack(rows.counts, rows.dtype)
    return MaskRows(dtype, _pack(ids, dtype), _pack(counts, dtype), rows.logprobs)


def _widen(mask: SamplingMask) -> None:
    if mask.dtype == "int32":
        return
    mask.ids = _pack(_unpack(mask.ids, mask.dtype), "int32")
    mask.counts = _pack(_unpack(mask.counts, mask.dtype), "int32")
    mask.dtype = "int32"


def switch(sample: Sample, on: bool) -> None:
    """`/resume return_sampling_mask`: on from the next segment (earlier tokens get empty
    rows then), or off (the record is dropped)."""
    sample.return_sampling_mask = on
    if not on:
        sample.sampling_mask = None


def reset(sample: Sample) -> None:
    """Forget the rows (the output they described was thrown away); the setting stays."""
    sample.sampling_mask = None
