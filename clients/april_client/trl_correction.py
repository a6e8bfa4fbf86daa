"""`stale_tokens="correct"`: TRL's clipped ratio taken against the policy that sampled each token.

TRL 1.16's GRPO loss is PPO's: per token, -min(r * A, clip(r, 1 - eps, 1 + eps) * A) with
r = pi_theta / pi_old. With one optimizer step per generation (the default) TRL takes pi_old
to be the trainer's own policy at the step (`per_token_logps.detach()`): r is 1 and a token
sampled under weights several pushes old trains exactly as if it had been sampled now. TRL
corrects that only for its vLLM path (`vllm_importance_sampling_correction`).

Here pi_old is the sampling policy instead: the server's logprob of each token as it was
sampled, which `AprilRollout` returns as `logprobs` and TRL keeps as `sampling_per_token_logps`.
r is then the importance weight of an off-policy token, clipped like the later epochs of PPO
(AReaL's decoupled objective with the behaviour policy as its proximal one): a stale token the
policy has since made more than 1 + eps likelier no longer pushes it further when its
advantage is positive, nor one made less than 1 - eps as likely when its advantage is
negative. A fresh token's r is 1 up to the rounding between the server's kernels and the
trainer's. Tokens appended by a tool carry logprob 0 and are outside the loss mask already.

Truncated sampling (top-k, top-p): SGLang's logprob is over the whole vocabulary (after the
temperature, before truncation), but the sampler drew from the kept set, so a ratio against
it is off by the kept set's mass, below 1 for every token. With `AprilRollout(sampling_mask=
True)` the returned `logprobs` are over each token's kept set (docs/api.md, Sampling mask) and
`use_kept_sets` makes the trainer's own logprobs over the same sets: a fresh token's ratio is
1 again, under any `stale_tokens`.

Both hook TRL methods on the trainer instance (not the class), installed at the adapter's
first call, which TRL makes before its first loss: `_compute_loss` sees each batch with
`old_per_token_logps` = the sampling logprobs. The methods are private, so the hooks check
the TRL version they were written for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

TRL_SERIES = "1.16."  # the adapter's pin (pyproject.toml, extra `trl`)
_HOOKED = "_april_sampling_old_logps"


def use_sampling_policy_as_old(trainer: Any) -> None:
    """Make `trainer`'s loss take its ratio against the sampling policy (idempotent)."""
    if getattr(trainer, _HOOKED, False):
        return
    _check_trl()
    inner = trainer._compute_loss

    def compute_loss(model: Any, inputs: dict[str, Any]) -> Any:
        return inner(model, with_sampling_old_logps(inputs))

    trainer._compute_loss = compute_loss
    setattr(trainer, _HOOKED, True)


def _check_trl() -> None:
    import trl

    if not str(trl.__version__).startswith(TRL_SERIES):
        raise RuntimeError(
            f"stale_tokens='correct' and sampling masks hook TRL {TRL_SERIES}x internals; this "
            f"is TRL {trl.__version__}. Use stale_tokens='keep' or 'mask' without sampling "
            f"masks, or TRL {TRL_SERIES}x."
        )


def with_sampling_old_logps(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` with `old_per_token_logps` set to its sampling logprobs (a new dict)."""
    sampling = batch.get("sampling_per_token_logps")
    if sampling is None:
        raise RuntimeError(
            "stale_tokens='correct' needs the sampling logprobs (rollout_func's `logprobs`), "
            "and TRL passed none for this batch"
        )
    return {**batch, "old_per_token_logps": sampling}


# ---- sampling masks: the trainer's logprobs over the sampler's kept sets ---------------------

_KEPT_HOOKED = "_april_kept_sets"
_TABLES = "_april_kept_tables"  # the kept sets of the last rollout calls' rows, newest last
KEPT_CALLS = 8  # rollout calls remembered: TRL may score a generation over several steps


@dataclass(frozen=True)
class KeptRow:
    """One row the rollout function returned: its prompt and completion ids, and each
    completion token's kept ids (`ids[offsets[j]:offsets[j + 1]]`; empty: none)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    ids: list[int]
    offsets: list[int]


def set_kept_rows(trainer: Any, rows: list[KeptRow]) -> None:
    """Remember the kept sets of a rollout call's rows, found again by their tokens."""
    tables: deque[dict[tuple[int, ...], list[KeptRow]]] = trainer.__dict__.setdefault(
        _TABLES, deque(maxlen=KEPT_CALLS)
    )
    table: dict[tuple[int, ...], list[KeptRow]] = {}
    for row in rows:
        table.setdefault(tuple(row.prompt_ids), []).append(row)
    tables.append(table)


def kept_rows_of(trainer: Any, input_ids: Any, attention_mask: Any, n: int) -> list[KeptRow | None]:
    """The remembered row of each of TRL's rows (left-padded prompt, then the completion,
    right-padded, its last `n` columns); None where none matches. TRL shuffles and splits a
    generation's rows, so a row is found by its tokens: the prompt as its attention mask shows
    it, the longest remembered completion the padded one starts with, of the newest call among
    equals (rows of equal tokens have equal kept sets: the same context under the same
    weights; a shorter one is a prefix whose kept sets are the same where it has tokens)."""
    tables = trainer.__dict__.get(_TABLES) or ()
    out: list[KeptRow | None] = []
    for ids, mask in zip(input_ids.tolist(), attention_mask[:, :-n].tolist(), strict=True):
        prompt = tuple(t for t, m in zip(ids[:-n], mask, strict=True) if m)
        completion = ids[-n:]
        found: KeptRow | None = None
        for table in reversed(tables):  # the newest first: it wins a tie
            for r in table.get(prompt, ()):
                fits = completion[: len(r.completion_ids)] == r.completion_ids
                if fits and (found is None or len(r.completion_ids) > len(found.completion_ids)):
                    found = r
        out.append(found)
    return out


def use_kept_sets(trainer: Any) -> None:
    """Make every per-token logprob `trainer` computes for the adapter's rows a logprob over the
    token's kept set, renormalised, as the server's sampling logprob is (idempotent).

    TRL scores a completion over the whole vocabulary; a token sampled with top-k / top-p was
    drawn from the kept set only, so a ratio against its sampling logprob is off by the kept
    set's mass (below 1 for every fresh token). Renormalising both sides over the same set
    makes a fresh token's ratio 1. One hook on the instance, TRL's logprob function, for the
    policy, old and reference logprobs alike: it finds each row's kept sets (`kept_rows_of`)
    and masks the logits outside them (a token with none, e.g. a tool's answer, a row not
    found, padding, stays over the whole vocabulary). Entropies stay over the whole
    vocabulary. The masked path materialises the logits (`[batch, completion, vocab]`)
    instead of TRL's fused head."""
    if getattr(trainer, _KEPT_HOOKED, False):
        return
    _check_trl()
    logps = trainer._get_per_token_logps_and_entropies

    def per_token_logps(
        model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, *a: Any, **kw: Any
    ) -> Any:
        rows = kept_rows_of(trainer, input_ids, attention_mask, logits_to_keep)
        if not any(rows):
            return logps(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        return kept_set_logps(
            trainer, model, input_ids, attention_mask, logits_to_keep, rows, *a, **kw
        )

    trainer._get_per_token_logps_and_entropies = per_token_logps
    setattr(trainer, _KEPT_HOOKED, True)


def kept_set_logps(
    trainer: Any,
    model: Any,
    input_ids: Any,
    attention_mask: Any,
    logits_to_keep: int,
    rows: list[KeptRow | None],
    batch_size: int | None = None,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    **multimodal: Any,
) -> tuple[Any, Any, Any]:
    """TRL's `_get_per_token_logps_and_entropies` for text rows, each completion token's
    logprob taken over its kept set (`rows[b]`; None: over the whole vocabulary)."""
    import torch

    if any(v is not None for v in multimodal.values()):
        raise RuntimeError("sampling masks: multimodal inputs are not supported")
    size = batch_size or input_ids.size(0)
    all_logps, all_entropies, aux = [], [], []
    for start in range(0, input_ids.size(0), size):
        ids = input_ids[start : start + size]
        extra = {"output_router_logits": True} if compute_aux_loss else {}
        with trainer.accelerator.autocast():
            mask = attention_mask[start : start + size]
            out = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
        logits = out.logits[:, -logits_to_keep - 1 : -1, :].float() / trainer.temperature
        keep = torch.ones_like(logits, dtype=torch.bool)
        for b, row in enumerate(rows[start : start + size]):
            if row is None:
                continue
            for j in range(min(logits_to_keep, len(row.offsets) - 1)):
                lo, hi = row.offsets[j], row.offsets[j + 1]
                if hi > lo:  # an empty span (a tool's answer, no row) keeps the vocabulary
                    keep[b, j] = False
                    keep[b, j, torch.tensor(row.ids[lo:hi], device=logits.device)] = True
        targets = ids[:, -logits_to_keep:].unsqueeze(-1)
        masked = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)
        all_logps.append(masked.gather(-1, targets).squeeze(-1))
        if compute_entropy:
            full = torch.log_softmax(logits, -1)
            all_entropies.append(-(full.exp() * full).sum(-1))
        if compute_aux_loss:
            aux.append(out.aux_loss)
    entropies = torch.cat(all_entropies, 0) if compute_entropy else None
    return torch.cat(all_logps, 0), entropies, torch.stack(aux).mean() if aux else None
