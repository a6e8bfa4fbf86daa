"""`stale_tokens="correct"`: TRL's clipped ratio taken against the policy that sampled each token.

TRL 1.16's GRPO loss is PPO's: per token, -min(r * A, clip(r, 1 - eps, 1 + eps) * A) with
r = pi_theta / pi_old. With one optimizer step per generation (the default) TRL takes pi_old
to be the trainer's own policy at the step (`per_token_logps.detach()`): r is 1 and a token
sampled under weights several pushes old trains exactly as if it had been sampled now. TRL
corrects that only for its vLLM path (`vllm_importance_sampling_correction`).

Here pi_old is the sampling policy instead: the server's logprob of each token as it was
sampled (after temperature and top-p, SGLang's default), which `AprilRollout` returns as
`logprobs` and TRL keeps as `sampling_per_token_logps`. r is then the importance weight of an
off-policy token, clipped like the later epochs of PPO (AReaL's decoupled objective with the
behaviour policy as its proximal one): a stale token the policy has since made more than
1 + eps likelier no longer pushes it further when its advantage is positive, nor one made
less than 1 - eps as likely when its advantage is negative. A fresh token's r is 1 up to the
rounding between the server's kernels and the trainer's. Tokens appended by a tool carry
logprob 0 and are outside the loss mask already.

It hooks one TRL method on the trainer instance (not the class): `_compute_loss` sees each
batch with `old_per_token_logps` = the sampling logprobs. It is installed at the adapter's
first call, which TRL makes before its first loss. The method is private, so the hook checks
the TRL version it was written for.
"""

from __future__ import annotations

from typing import Any

TRL_SERIES = "1.16."  # the adapter's pin (pyproject.toml, extra `trl`)
_HOOKED = "_april_sampling_old_logps"


def use_sampling_policy_as_old(trainer: Any) -> None:
    """Make `trainer`'s loss take its ratio against the sampling policy (idempotent)."""
    if getattr(trainer, _HOOKED, False):
        return
    import trl

    if not str(trl.__version__).startswith(TRL_SERIES):
        raise RuntimeError(
            f"stale_tokens='correct' hooks TRL {TRL_SERIES}x internals; this is TRL "
            f"{trl.__version__}. Use stale_tokens='keep' or 'mask', or TRL {TRL_SERIES}x."
        )
    inner = trainer._compute_loss

    def compute_loss(model: Any, inputs: dict[str, Any]) -> Any:
        return inner(model, with_sampling_old_logps(inputs))

    trainer._compute_loss = compute_loss
    setattr(trainer, _HOOKED, True)


def with_sampling_old_logps(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` with `old_per_token_logps` set to its sampling logprobs (a new dict)."""
    sampling = batch.get("sampling_per_token_logps")
    if sampling is None:
        raise RuntimeError(
            "stale_tokens='correct' needs the sampling logprobs (rollout_func's `logprobs`), "
            "and TRL passed none for this batch"
        )
    return {**batch, "old_per_token_logps": sampling}
