"""What the TRL end-to-end tests share: a GRPO run of TRL's own trainer on april-server through
the adapter, every call's response and every step's rows recorded, run in a fresh interpreter
(in the full suite, training in-process learned measurably less). The TRL tests share one server
(`weights_server`); each run pushes its own weights from its first step, and the server is given
the tiny model's weights back after each run, so no run sees another's.

Each test runs at two sizes: `quick` (a few steps: every check of the rows, versions, staleness
and ledger; `make test`) and `full` (the learning-curve run: the same checks and the reward rising
beyond noise; `make test-slow`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from april_client.protocol import RolloutResp
from april_client.trl import AprilRollout
from april_server.models import ensure_tiny_model
from tests.server_proc import ServerProc

PROMPTS, N = 8, 4  # groups per step, samples per group

Reward = Callable[..., list[float | None]]


def welch_z(before: list[float], after: list[float]) -> float:
    se = statistics.pvariance(before) / len(before) + statistics.pvariance(after) / len(after)
    return (statistics.fmean(after) - statistics.fmean(before)) / max(se**0.5, 1e-9)


def check_reward(scored: dict[int, list[float]], steps: int, full: int, label: str) -> None:
    """Every step scored; in the learning-curve run (`steps == full`), the reward of the last 3
    steps beyond noise above the first 3's (Welch z > 3). A quick run cannot show it."""
    done = sorted(scored)
    assert len(done) == steps
    if steps != full:
        return
    first = [v for s in done[:3] for v in scored[s]]
    last = [v for s in done[-3:] for v in scored[s]]
    z = welch_z(first, last)
    before, after = statistics.fmean(first), statistics.fmean(last)
    means = [round(statistics.fmean(scored[k]), 3) for k in done]
    print(f"{label} {before:.3f} -> {after:.3f}, z={z:.1f}, per step {means}")
    assert z > 3, (before, after, z, means)


def grpo_run(
    adapter: AprilRollout,
    sender: Any,
    scored_reward: Reward,
    rows: list[dict[str, Any]],
    workdir: str,
    steps: int,
    max_completion_length: int,
    more_rewards: tuple[Reward, ...] = (),
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train `steps` steps; `sender.rollout` (what sends the adapter's calls) is wrapped to
    record each response, `scored_reward`'s values are recorded by step. `config`: more
    `GRPOConfig` settings (over the defaults below)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    model_path = ensure_tiny_model()
    outputs: list[tuple[int, dict[str, Any]]] = []
    responses: list[RolloutResp] = []
    send = sender.rollout

    def capture(*args: Any, **kw: Any) -> RolloutResp:
        responses.append(send(*args, **kw))
        return responses[-1]

    sender.rollout = capture

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        out = adapter(prompts, trainer)
        outputs.append((int(trainer.state.global_step), out))
        return out

    scored: dict[int, list[float]] = {}

    def recorded(completions: list[str], **kw: Any) -> list[float | None]:
        values = scored_reward(completions, **kw)
        scored[int(kw["trainer_state"].global_step)] = [float(v or 0.0) for v in values]
        return values

    settings: dict[str, Any] = dict(
        output_dir=str(Path(workdir) / "trainer"),
        per_device_train_batch_size=PROMPTS * N,
        num_generations=N,
        max_completion_length=max_completion_length,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_steps=steps,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    args = GRPOConfig(**{**settings, **(config or {})})
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path),
        reward_funcs=[recorded, *more_rewards],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        rollout_func=rollout,
        callbacks=[adapter.callback()],
    )
    trainer.train()
    return {
        "scored": scored,
        "outputs": outputs,
        "responses": responses,
        "records": adapter.records,
        "ledger": adapter.ledger,
        "log_history": trainer.state.log_history,
    }


@contextlib.contextmanager
def trained(
    server: ServerProc, tmp_path: Path, train: Callable[[str, str, int], dict[str, Any]], steps: int
) -> Iterator[dict[str, Any]]:
    """`train(url, workdir, steps)` run on `server` (`weights_server`, which gets the tiny
    model's weights back after the test) in a fresh interpreter."""
    with mp.get_context("spawn").Pool(1) as pool:
        yield pool.apply(train, (server.url, str(tmp_path), steps))
