"""What a trainer computes from a returned sample with a sampling mask: the tiny model's own
forward pass (transformers, fp32, independent of SGLang) over the sample's context, its logits
divided by the temperature, renormalised over each token's returned row.

Two checks for the e2e tests of the sampling mask:
- `recompute_gap`: the trainer's renormalised logprob of every generated token against the
  server's sampling logprob (their largest absolute difference);
- `check_kept_sets`: every row is the kept set of its step, rebuilt here from the model's
  probabilities with SGLang's rule (the `top_k` most likely, then those whose more likely
  predecessors hold at most `top_p` of the mass), allowing only tokens within `EPS` of a
  cutoff to fall either way (fp32 kernels differ in the last bits). A row recorded for the
  wrong token, or shifted by one position across a cut, fails it.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

import numpy as np
import torch

from april_server.models import ensure_tiny_model

EPS = 1e-4  # probability mass: far above fp32 drift (~1e-6), far below a typical gap


@functools.cache
def _model() -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    return model.eval()


def rows(mask: dict[str, Any]) -> list[list[int]]:
    """A JSON `sampling_mask`'s rows (decoded here, not by the client under test)."""
    dtype = np.dtype("<i4" if mask["dtype"] == "int32" else "<u2")
    ids = np.frombuffer(base64.b64decode(mask["ids"]), dtype=dtype).tolist()
    counts = np.frombuffer(base64.b64decode(mask["counts"]), dtype=dtype).tolist()
    out, at = [], 0
    for n in counts:
        out.append(ids[at : at + n])
        at += n
    return out


def _context_and_positions(sample: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The sample's context (prompt, output, appended in place) and where each output token
    sits in it."""
    ctx = list(sample["prompt_ids"])
    where: list[int] = []
    out = sample["output_ids"]
    pos = 0
    for ap in sample["appended"]:
        where += range(len(ctx), len(ctx) + ap["at"] - pos)
        ctx += out[pos : ap["at"]] + ap["ids"]
        pos = ap["at"]
    where += range(len(ctx), len(ctx) + len(out) - pos)
    ctx += out[pos:]
    return ctx, where


def step_logits(sample: dict[str, Any], temperature: float) -> torch.Tensor:
    """`[len(output_ids), vocab]`: the logits each output token was sampled from, / temperature."""
    ctx, where = _context_and_positions(sample)
    with torch.no_grad():
        logits = _model()(torch.tensor([ctx])).logits[0].float()
    return logits[torch.tensor(where) - 1] / temperature


def recompute_gap(sample: dict[str, Any], temperature: float) -> float:
    """max |trainer's logprob over the row - the server's sampling logprob| over every token."""
    mask = sample["sampling_mask"]
    logits = step_logits(sample, temperature)
    worst = 0.0
    for i, (tok, row) in enumerate(zip(sample["output_ids"], rows(mask), strict=True)):
        kept = logits[i, torch.tensor(row)]
        mine = float(logits[i, tok] - torch.logsumexp(kept, 0))
        worst = max(worst, abs(mine - mask["logprobs"][i]))
    return worst


def check_kept_sets(sample: dict[str, Any], temperature: float, top_k: int, top_p: float) -> int:
    """Assert each row is its step's kept set (up to `EPS` at a cutoff); returns how many rows
    had a token that near a cutoff."""
    logits = step_logits(sample, temperature)
    near = 0
    for i, (tok, row) in enumerate(
        zip(sample["output_ids"], rows(sample["sampling_mask"]), strict=True)
    ):
        probs = torch.softmax(logits[i].double(), 0)
        order = torch.argsort(probs, descending=True)
        p = probs[order]
        before = torch.cumsum(p, 0) - p  # mass of the more likely tokens
        k = min(top_k, len(p))
        rank_ok = p >= float(p[k - 1]) - EPS  # may be among the top_k
        rank_sure = p > float(p[k]) + EPS if k < len(p) else p >= 0  # surely among them
        surely = set(order[rank_sure & (before < top_p - EPS)].tolist())
        maybe = set(order[rank_ok & (before <= top_p + EPS)].tolist())
        got = set(row)
        assert tok in got, (i, tok, row)
        assert surely <= got <= maybe, (i, sorted(surely - got), sorted(got - maybe))
        near += surely != maybe
    return near
