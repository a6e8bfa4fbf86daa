"""`stale_tokens="correct"` on TRL's own loss: the clipped ratio against the sampling policy.

A real `GRPOTrainer` (tiny model, CPU) and its real `_compute_loss`, fed one crafted batch:
with sampling logprobs equal to the trainer's own, the hooked loss is TRL's loss; with one
token sampled when it was e times less likely than now (a stale token the policy has since
learned), its ratio is clipped at 1 + epsilon and it no longer pushes the policy.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from april_client.trl import AprilRollout  # noqa: E402
from april_client.trl_correction import (  # noqa: E402
    KeptRow,
    kept_rows_of,
    kept_set_logps,
    set_kept_rows,
    use_kept_sets,
    use_sampling_policy_as_old,
    with_sampling_old_logps,
)

EPS = 0.2  # TRL's default epsilon (the clip range), set explicitly below


def _trainer(tmp_path: Path, **config: Any) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from april_server.models import ensure_tiny_model

    path = ensure_tiny_model()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        epsilon=EPS,
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **config,
    )
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
        processing_class=AutoTokenizer.from_pretrained(path),
        rollout_func=lambda prompts, trainer: {},
    )


def _batch(trainer: Any) -> dict[str, Any]:
    prompt, completion = torch.tensor([[5, 6, 7]]), torch.tensor([[11, 12, 13]])
    batch = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": torch.ones_like(completion),
        "advantages": torch.tensor([1.0]),
        "num_items_in_batch": torch.tensor(3.0),
    }
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt, completion], 1), torch.ones(1, 6), 3
        )
    batch["sampling_per_token_logps"] = logps.clone()
    return batch


def _loss_and_grad(trainer: Any, batch: dict[str, Any]) -> tuple[float, Any]:
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    head = trainer.model.get_output_embeddings().weight.grad
    return float(loss.detach()), head.clone()


def test_the_ratio_is_taken_against_the_sampling_policy_and_clipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    trainer = _trainer(tmp_path, loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() sets per step
    batch = _batch(trainer)
    plain, plain_grad = _loss_and_grad(trainer, batch)
    assert plain == pytest.approx(-1.0, abs=1e-5)  # ratio 1 everywhere: -A per token

    use_sampling_policy_as_old(trainer)
    use_sampling_policy_as_old(trainer)  # idempotent: one hook, not two
    same, same_grad = _loss_and_grad(trainer, batch)
    assert same == pytest.approx(plain, abs=1e-5)  # fresh tokens: TRL's loss
    assert torch.allclose(same_grad, plain_grad, atol=1e-6)

    # Token 1 was sampled e times less likely than the policy now makes it: ratio e,
    # clipped at 1 + eps (advantage > 0), so its loss is -(1 + eps) and it adds no gradient.
    stale = dict(batch, sampling_per_token_logps=batch["sampling_per_token_logps"].clone())
    stale["sampling_per_token_logps"][0, 1] -= 1.0
    loss, grad = _loss_and_grad(trainer, stale)
    assert loss == pytest.approx(-(1 + 1 + EPS + 1) / 3, abs=1e-4)
    # Only tokens 0 and 2 push: the gradient is TRL's with token 1 left out of the loss.
    # (tool_mask: out of the loss, still in the attention, as TRL masks tool answers)
    two_tokens = dict(batch, tool_mask=torch.tensor([[1, 0, 1]]))
    trainer._compute_loss = type(trainer)._compute_loss.__get__(trainer)  # unhooked again
    _, two_tokens_grad = _loss_and_grad(trainer, two_tokens)
    assert torch.allclose(grad * 3, two_tokens_grad * 2, atol=1e-5)  # means over 3 vs 2
    assert not torch.allclose(grad, plain_grad, atol=1e-6)


def test_with_cispo_a_stale_token_keeps_its_gradient_weighted_by_its_capped_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pairing docs/trainers.md recommends for background batches: TRL's `cispo` loss
    takes the ratio as an importance weight, capped at `epsilon_high` and kept out of the
    gradient, so the stale token the clipped loss above drops still pushes, e times harder."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    cap = 5.0
    trainer = _trainer(tmp_path, loss_type="cispo", epsilon_high=cap)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = _batch(trainer)
    # TRL's cispo divides by the batch's token count, the same in every call below: the
    # gradient is linear in each token's weight, so token 1's own part is fresh - without it.
    _, without_1 = _loss_and_grad(trainer, dict(batch, tool_mask=torch.tensor([[1, 0, 1]])))
    use_sampling_policy_as_old(trainer)
    _, fresh = _loss_and_grad(trainer, batch)
    token_1 = fresh - without_1
    assert token_1.abs().max() > 0
    for drop, weight in ((1.0, torch.e), (2.0, cap)):  # ratio e, then e^2 > cap: capped
        stale = dict(batch, sampling_per_token_logps=batch["sampling_per_token_logps"].clone())
        stale["sampling_per_token_logps"][0, 1] -= drop
        _, grad = _loss_and_grad(trainer, stale)
        assert torch.allclose(grad, without_1 + weight * token_1, atol=1e-5)


def test_a_batch_without_sampling_logprobs_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="sampling logprobs"):
        with_sampling_old_logps({"completion_ids": []})
    batch = {"sampling_per_token_logps": "s"}
    assert with_sampling_old_logps(batch) == {**batch, "old_per_token_logps": "s"}
    assert "old_per_token_logps" not in batch  # the caller's dict is left as it was


def test_the_adapter_takes_correct_and_rejects_anything_else() -> None:
    assert AprilRollout(object(), stale_tokens="correct").stale_tokens == "correct"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'mask', 'keep' or 'correct'"):
        AprilRollout(object(), stale_tokens="fix")  # type: ignore[arg-type]


def test_another_trl_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import trl

    monkeypatch.setattr(trl, "__version__", "2.0.0")
    with pytest.raises(RuntimeError, match="hook TRL 1.16.x internals"):
        use_sampling_policy_as_old(object())


# ---- sampling masks: the trainer's logprobs over the kept sets --------------------------------

# `_batch`'s row: token 11 kept {3, 11, 40}, 12 no kept set, 13 kept {7, 13}.
ROW = KeptRow([5, 6, 7], [11, 12, 13], [3, 11, 40, 7, 13], [0, 3, 3, 5])


def _kept_batch(trainer: Any) -> dict[str, Any]:
    """`_batch` whose sampling logprobs are over the kept sets, as the server's: each token
    fresh (the trainer's own policy) under truncated sampling."""
    batch = _batch(trainer)
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        logits = trainer.model(input_ids=ids).logits[0, 2:5] / trainer.temperature
    full = torch.log_softmax(logits, -1)
    own = full.gather(-1, batch["completion_ids"][0].unsqueeze(-1)).squeeze(-1)
    renorm = own.clone()
    for j, kept in ((0, [3, 11, 40]), (2, [7, 13])):
        renorm[j] = own[j] - torch.logsumexp(full[j, kept], 0)
    batch["sampling_per_token_logps"] = renorm.unsqueeze(0)
    batch["full_logps"] = own.unsqueeze(0)
    return batch


def test_kept_set_logps_renormalise_over_each_tokens_kept_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against TRL's own fused head: the same logprob and entropy where a token has no kept
    set, its logprob less the log of its kept set's mass where it has one."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = _trainer(tmp_path, loss_type="grpo")
    batch = _kept_batch(trainer)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    args = (trainer.model, ids, torch.ones(1, 6), 3)
    with torch.no_grad():
        trl_logps, trl_ent, _ = trainer._get_per_token_logps_and_entropies(
            *args, compute_entropy=True
        )
        logps, ent, aux = kept_set_logps(trainer, *args, [ROW], compute_entropy=True)
    assert aux is None
    assert torch.allclose(trl_logps, batch["full_logps"], atol=1e-5)  # the reference is TRL's
    assert torch.allclose(logps, batch["sampling_per_token_logps"], atol=1e-5)
    assert logps[0, 1] == pytest.approx(float(trl_logps[0, 1]), abs=1e-5)  # no kept set
    assert (logps[0, [0, 2]] > trl_logps[0, [0, 2]]).all()  # mass below 1: renormalised up
    assert torch.allclose(ent, trl_ent, atol=1e-4)  # entropies stay over the vocabulary


def test_with_kept_sets_a_fresh_tokens_ratio_is_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling logprobs over the kept sets against the trainer's over the whole vocabulary:
    a fresh truncated token's ratio is its kept set's mass, below 1 (its loss -r, not -1).
    Over the same kept sets (the hook), every ratio is 1: TRL's loss with fresh tokens."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = _trainer(tmp_path, loss_type="grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = _kept_batch(trainer)
    mass = (batch.pop("full_logps") - batch["sampling_per_token_logps"]).exp()[0]
    assert mass[1] == pytest.approx(1.0) and (mass[[0, 2]] < 0.999).all()
    use_sampling_policy_as_old(trainer)
    unmasked, _ = _loss_and_grad(trainer, batch)
    assert unmasked == pytest.approx(-float(mass.mean()), abs=1e-5)  # -r per token (A = 1)
    use_kept_sets(trainer)
    use_kept_sets(trainer)  # idempotent
    set_kept_rows(trainer, [ROW])  # what the rollout function does
    masked, _ = _loss_and_grad(trainer, batch)
    assert masked == pytest.approx(-1.0, abs=1e-5)  # ratio 1 everywhere: -A per token


def test_rows_are_found_by_their_tokens_whatever_trl_did_to_them() -> None:
    """TRL pads prompts on the left and completions on the right, shuffles the rows and splits
    them: each is found again by its prompt (as its attention mask shows it) and the longest
    remembered completion it starts with, the newest call's among equals; None when none fits."""
    trainer = SimpleNamespace()
    old = KeptRow([1, 2], [9, 9], [9], [0, 1, 1])
    old_short = KeptRow([1, 2], [9], [9, 5], [0, 2])
    set_kept_rows(trainer, [old, old_short])
    short = KeptRow([1, 2], [9], [9, 4], [0, 2])
    long = KeptRow([1, 2], [9, 9, 8], [9, 3, 9, 8], [0, 2, 3, 4])
    other = KeptRow([3], [5, 6], [5, 6], [0, 1, 2])
    set_kept_rows(trainer, [short, long, other])
    pad = 0
    ids = torch.tensor(
        [
            [pad, 3, 5, 6, pad],  # other, padded both sides
            [1, 2, 9, 9, 8],  # long
            [1, 2, 9, pad, pad],  # short
            [1, 2, 9, 9, pad],  # the old call's [9, 9]: longer than any newer fit
            [1, 7, 9, pad, pad],  # nobody's
        ]
    )
    attention = torch.tensor([[0, 1, 1, 1, 0]] + [[1, 1, 1, 1, 1]] * 4)
    found = kept_rows_of(trainer, ids, attention, 3)
    assert found == [other, long, short, old, None]  # short: as old_short, but newer
