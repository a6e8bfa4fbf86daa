"""`stale_tokens="correct"` on TRL's own loss: the clipped ratio against the sampling policy.

A real `GRPOTrainer` (tiny model, CPU) and its real `_compute_loss`, fed one crafted batch:
with sampling logprobs equal to the trainer's own, the hooked loss is TRL's loss; with one
token sampled when it was e times less likely than now (a stale token the policy has since
learned), its ratio is clipped at 1 + epsilon and it no longer pushes the policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from april_client.trl import AprilRollout  # noqa: E402
from april_client.trl_correction import (  # noqa: E402
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
    with pytest.raises(RuntimeError, match="hooks TRL 1.16.x internals"):
        use_sampling_policy_as_old(object())
