"""TRL's GRPOTrainer trains an agent with a tool against a real april-server (#20 item 5).

The toy task: each prompt names a key; its dataset row holds the key's secret digit. The model
calls the tool by emitting `@` (token CALL, the turn stop); the tool looks the key up in the
row and answers " key K is D." (appended, env_mask 0); the episode goes on for one more turn.
Reward: 0 without a tool call, 0.5 with one, 1 when the text after the tool's answer also
holds the secret digit (it used the answer). One run of STEPS optimizer steps, APRIL
(over-provisioning 2, stale tokens kept, so env_mask 0 is exactly the tool's tokens; weights
pushed from disk, where the other TRL test broadcasts them); then
(the quick run, `make test`: QUICK_STEPS steps, 20 call tokens, every check but the reward's):
- the rows TRL received: completion_ids = the server's whole response (generated + the
  tool's tokens in place), env_mask 0 exactly on the tool's tokens, logprobs 0.0 there and
  the sampling logprobs elsewhere, the answer appended right after the turn's `@` and equal to
  the lookup of the row the group was built from;
- the reward rises: mean of the last 3 steps vs the first 3 (96 samples each), Welch z > 3;
- nothing of the run stays on the server.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from april_client import AprilClient
from april_client.trl import AprilRollout
from april_client.trl_tools import ToolCall
from april_server.models import ensure_tiny_model
from tests.e2e.grpo_run import PROMPTS, N, check_reward, grpo_run, trained
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e

STEPS = 16  # the learning-curve run (`full`)
QUICK_STEPS = 4  # `make test`: every check of the rows, none of the learning
SIZES = [
    pytest.param(QUICK_STEPS, id="quick"),
    pytest.param(STEPS, id="full", marks=pytest.mark.slow),
]
CALL = 34  # "@" in the tiny tokenizer: ~1.6 % of its samples at temperature 1
# The quick run ends a turn at any of 20 tokens (CALL among them), so its few steps are sure to
# call the tool: at 1.6 % a sample, 128 samples would miss it about one run in eight.
QUICK_CALLS = list(range(30, 50))


def turns_for(steps: int) -> dict[str, Any]:
    return {"stop_token_ids": [CALL] if steps == STEPS else QUICK_CALLS, "max_turns": 2}


def dataset(size: int = 256, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        key, secret = rng.randint(0, 99), rng.randint(0, 9)
        prompt = f"Task {rng.randint(0, 99)}: look up key {key}, then answer its digit. Answer:"
        rows.append({"prompt": prompt, "key": str(key), "secret": str(secret)})
    return rows


def answer_text(row: dict[str, Any]) -> str:
    return f" key {row['key']} is {row['secret']}."


def lookup(call: ToolCall) -> str:
    """The tool: a lookup in the row the prompt was built from."""
    assert call.ids[-1] in QUICK_CALLS and call.turn == 1
    return answer_text(call.metadata)


def tool_reward(
    completions: list[str], april_tool_calls: list[int], key: list[str], secret: list[str], **_: Any
) -> list[float | None]:
    out: list[float | None] = []
    for text, calls, k, s in zip(completions, april_tool_calls, key, secret, strict=True):
        marker = answer_text({"key": k, "secret": s})
        if not calls or marker not in text:
            out.append(0.0)
            continue
        after = text.split(marker, 1)[1]
        out.append(1.0 if s in after else 0.5)
    return out


def train(url: str, workdir: str, steps: int) -> dict[str, Any]:
    """The training run, in a fresh interpreter (`grpo_run.trained`)."""
    client = AprilClient(url, timeout=600)
    adapter = AprilRollout(
        client,
        over_provision=2.0,
        max_staleness=1,
        stale_tokens="keep",
        max_inflight_groups=2 * PROMPTS,
        run_id="trl-tools",
        seed=0,
        tool=lookup,
        turns=turns_for(steps),
        weight_sync="disk",  # the GRPO test covers the default
    )
    assert adapter._tools is not None
    return grpo_run(
        adapter,
        adapter._tools,
        tool_reward,
        dataset(seed=0),
        workdir,
        steps,
        max_completion_length=32,
    )


@pytest.mark.parametrize("steps", SIZES)
def test_grpo_trainer_learns_to_use_a_tool_on_april_server(
    weights_server: ServerProc, tmp_path: Path, steps: int
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    server, calls = weights_server, turns_for(steps)["stop_token_ids"]
    with trained(server, tmp_path, train, steps) as run:
        scored, outputs, responses = run["scored"], run["outputs"], run["responses"]
        records, ledger = run["records"], run["ledger"]
        train_records = [r for r in records if r.mode == "train"]
        assert [r.step for r in train_records] == list(range(steps))

        # The rows TRL received: exactly the tool's tokens masked, aligned with completion_ids.
        tool_rows = 0
        for (step, out), rec in zip(outputs, train_records, strict=True):
            assert step == rec.step
            samples = [
                s
                for g in responses[rec.call].groups
                for s in sorted(g.samples, key=lambda s: s.index)
            ]
            assert len(samples) == len(out["completion_ids"]) == PROMPTS * N
            for i, s in enumerate(samples):
                ids, mask, lps = out["completion_ids"][i], out["env_mask"][i], out["logprobs"][i]
                assert len(ids) == len(mask) == len(lps)
                want_ids: list[int] = []
                tool_at: list[int] = []
                pos = 0
                for ap in s.appended:
                    want_ids += s.output_ids[pos : ap.at]
                    tool_at += range(len(want_ids), len(want_ids) + len(ap.ids))
                    want_ids += ap.ids
                    pos = ap.at
                want_ids += s.output_ids[pos:]
                assert ids == want_ids
                assert [j for j, m in enumerate(mask) if m == 0] == tool_at
                assert [lps[j] for j in tool_at] == [0.0] * len(tool_at)
                gen = [lps[j] for j in range(len(ids)) if mask[j] == 1]
                assert gen == list(s.output_logprobs)
                assert out["april_tool_calls"][i] == len(s.appended) <= 1
                if s.appended:
                    tool_rows += 1
                    (ap,) = s.appended
                    assert s.output_ids[ap.at - 1] in calls and s.turns[0].end == ap.at
                    row = {"key": out["key"][i], "secret": out["secret"][i]}
                    want = tokenizer(answer_text(row), add_special_tokens=False)["input_ids"]
                    assert ap.ids == want  # the lookup in this row's own metadata
        assert tool_rows > 0, "no tool call at all: the masking went untested"

        # The reward rises beyond noise (the learning-curve run only).
        check_reward(scored, steps, STEPS, f"tool reward (rows with a call: {tool_rows})")

        # Nothing of the run left on the server.
        assert ledger.outstanding() == []
        client = AprilClient(server.url, timeout=600)
        assert [g.group_id for g in client.partials() if g.group_id.startswith("trl-tools")] == []
        assert client.stats()["awaiting_input_samples"] == 0
