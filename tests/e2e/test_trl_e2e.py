"""TRL's own GRPOTrainer trains against a real april-server (APRIL mode, CPU, tiny model).

One run of STEPS optimizer steps (the quick run, `make test`: QUICK_STEPS, every check but the
reward's), weights broadcast over a gloo group (the adapter's default), with over-provisioning
2, `max_staleness=1` and stale tokens kept (the demo's APRIL setting; with `mask`, the first
characters a format reward looks at are mostly in masked stale segments, and 16 steps do not
move it beyond noise); then:
- reward rises beyond noise: per-sample format reward of the last 3 steps vs the first 3
  (96 samples each), Welch z-score > 3. How far it has risen by the last steps varies from run
  to run: sampling is not seeded (SGLang ignores seeds outside its deterministic mode, which
  on this CPU took 140-150 s per generating step instead of about 15). After 16 steps the last
  3 steps' mean was 0.16-0.28 over five runs from a start near 0.08 (z 6.4-10.3), and a run below
  about 0.14 fails: roughly 1 in 15 by that spread (1 run in 8 failed here before, its cause
  not recorded). 24 steps leave the rise more room (it grows by about 0.01 a step);
- every step's weights reached the server: the version the server reports for each call is
  the step, and every unmasked token was generated under it;
- each returned row is scored against its own group's dataset row (its prompt names its answer);
- no group is lost or returned twice, and nothing of the run stays on the server at the end;
- stale tokens are treated as documented: kept (env_mask all ones), within the contract's
  `max_staleness` (a sample continues only while its newest segment is at most that old), and
  there were some; `mask` would zero exactly them (checked on
  the same responses).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from april_client import AprilClient
from april_client.sampling_mask import sampling_logprobs
from april_client.trainer_batch import rows_from_groups
from april_client.trl import AprilRollout
from april_server.models import ensure_tiny_model
from examples import train_task
from tests.e2e.grpo_run import PROMPTS, N, check_reward, grpo_run, trained
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e

STEPS = 24  # the learning-curve run (`full`); see the module docstring
QUICK_STEPS = 6  # `make test`: enough for stragglers to carry stale tokens into later steps
SIZES = [
    pytest.param(QUICK_STEPS, id="quick"),
    pytest.param(STEPS, id="full", marks=pytest.mark.slow),
]


def train(url: str, workdir: str, steps: int) -> dict[str, Any]:
    """The training run, in a fresh interpreter (`grpo_run.trained`): what the checks need."""
    client = AprilClient(url, timeout=600)
    adapter = AprilRollout(
        client,
        over_provision=2.0,
        max_staleness=1,
        stale_tokens="keep",
        max_inflight_groups=2 * PROMPTS,
        run_id="trl-e2e",
        seed=0,
    )
    return grpo_run(
        adapter,
        client,
        train_task.digit_format,
        train_task.dataset(seed=0),
        workdir,
        steps,
        max_completion_length=128,
        more_rewards=(train_task.digit_match,),
    )


@pytest.mark.parametrize("steps", SIZES)
def test_grpo_trainer_learns_on_april_server(
    weights_server: ServerProc, tmp_path: Path, steps: int
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    server = weights_server
    with trained(server, tmp_path, train, steps) as run:
        scored, outputs, responses = run["scored"], run["outputs"], run["responses"]
        records, ledger = run["records"], run["ledger"]
        client = AprilClient(server.url, timeout=600)

        # Reward rises beyond noise (the learning-curve run only: a few steps cannot show it).
        check_reward(scored, steps, STEPS, "format reward")

        # Every step's weights reached the server before its rollout.
        train_records = [r for r in records if r.mode == "train"]
        assert [r.step for r in train_records] == list(range(steps))
        assert all(r.weight_version == str(r.step) for r in train_records)

        for (step, out), rec in zip(outputs, train_records, strict=True):
            assert step == rec.step
            rows = len(out["completion_ids"])
            assert rows == PROMPTS * N
            # Whole groups, contiguous, scored against their own row.
            gids = out["april_group_id"]
            assert all(len(set(gids[g * N : (g + 1) * N])) == 1 for g in range(PROMPTS))
            for i in range(0, rows, N):
                text = tokenizer.decode(out["prompt_ids"][i])
                assert f"the digit {out['answer'][i]}." in text, (text, out["answer"][i])
            # Stale tokens: kept, at most max_staleness old; `mask` would zero exactly them.
            assert all(m.count(0) == 0 for m in out["env_mask"])
            resp = responses[rec.call]
            for g in resp.groups:
                for smp in g.samples:
                    versions = [int(seg.weight_version) for seg in smp.segments] or [rec.step]
                    # The contract's bound (docs/api.md, `max_staleness`): a sample continues
                    # only while its newest segment is at most max_staleness versions old, so
                    # each segment is within 1 of the one before and the newest within 1 of
                    # the step. (Its oldest token may be older: a straggler continued twice.)
                    lags = [b - a for a, b in zip(versions, versions[1:], strict=False)]
                    assert rec.step - versions[-1] <= 1 and all(0 <= x <= 1 for x in lags), (
                        rec.step,
                        smp.sample_id,
                        versions,
                    )
            masked = rows_from_groups(resp.groups, N, rec.weight_version, "mask")
            assert sum(m.count(0) for m in masked.env_mask) == rec.stale_tokens
            assert masked.completion_ids == out["completion_ids"]
        assert sum(r.stale_tokens for r in train_records) > 0, "no stale tokens: staleness untested"

        # Nothing lost or duplicated; nothing of the run left on the server.
        assert ledger.outstanding() == []
        assert set(ledger.sent) == set(ledger.returned) | ledger.cleared
        assert not set(ledger.returned) & ledger.cleared
        left = [g.group_id for g in client.partials() if g.group_id.startswith("trl-e2e")]
        assert left == []
        assert client.stats()["buffered_groups"] == 0


def train_top_k(url: str, workdir: str, steps: int) -> dict[str, Any]:
    """A short run with top-k sampling, sampling masks and the ratio against the sampling
    policy, every token fresh (no over-provisioning: each call returns all it sent)."""
    client = AprilClient(url, timeout=600)
    adapter = AprilRollout(
        client, stale_tokens="correct", sampling_mask=True, run_id="trl-mask", seed=0
    )
    return grpo_run(
        adapter,
        client,
        train_task.digit_format,
        train_task.dataset(seed=0),
        workdir,
        steps,
        max_completion_length=32,
        config={"top_k": TOP_K, "epsilon": EPSILON},
    )


TOP_K = 3  # a small kept set: its mass often under 1 - epsilon
EPSILON = 0.2


def test_grpo_trainer_takes_fresh_ratios_of_one_over_the_kept_sets(
    weights_server: ServerProc, tmp_path: Path
) -> None:
    """Top-k sampling, every token fresh. The returned logprobs are over the kept sets, and
    a kept set's mass is often under 1 - epsilon: a trainer scoring over the whole vocabulary
    would take those tokens' ratios at that mass and clip the ones with a negative advantage
    (trl_correction.py; its unit test shows it on TRL's loss). TRL's own run, hooked to score
    over the same kept sets, takes every ratio at 1 and clips nothing."""
    with trained(weights_server, tmp_path, train_top_k, 2) as run:
        clipped = [h["clip_ratio/region_mean"] for h in run["log_history"] if "loss" in h]
        masses = []
        for (_, out), resp in zip(run["outputs"], run["responses"], strict=True):
            samples = [x for g in resp.groups for x in sorted(g.samples, key=lambda x: x.index)]
            assert out["logprobs"] == [sampling_logprobs(x) for x in samples]
            for x, kept in zip(samples, out["logprobs"], strict=True):
                masses += [math.exp(a - b) for a, b in zip(x.output_logprobs, kept, strict=True)]
        low = sum(m < 1 - EPSILON for m in masses) / len(masses)
        print(
            f"kept-set mass under 1 - epsilon for {low:.1%} of {len(masses)} tokens; "
            f"TRL's clip_ratio/region_mean per step {clipped}"
        )
        assert low > 0.05
        assert clipped == [0.0, 0.0]
