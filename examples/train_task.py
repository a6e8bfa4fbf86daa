"""The verifiable task of `make train-demo` and the TRL end-to-end test.

Each prompt asks for one digit ("Task 41: answer with the digit 7. Answer:"); its dataset row
carries the `answer`. Two rule-based rewards, both computed from the completion text alone:

- `digit_format`: the share of digits among the first 16 characters (a format reward: answer
  with digits, not words), in [0, 1];
- `digit_match`: 1 if the first digit in the completion is the row's `answer` and the completion
  ended (EOS) within its budget, else 0: like a math answer, a truncated one scores nothing.

Why it is a fair stand-in for verifiable-reward RL (math with a checked answer) on the tiny
random model: the reward is checked against per-prompt metadata, so a completion scored against
the wrong row (a buffered group returning in a later step) would be scored wrongly; lengths are
the model's own (sampling until its EOS or `max_completion_length`, a long tail from a few
tokens to the cap, the straggler pattern APRIL targets), not imposed; and the tiny model's
reward rises within tens of GRPO steps on 2 CPU cores (the format part first), so a learning
curve fits in minutes. It is not a reasoning task: the model cannot learn arithmetic here.

The long tail (`budget` column, `BUDGET_COLUMN`). Left to itself the tiny random model often
does not sample its EOS (in the TRL e2e test, 128-token cap, about two thirds of completions
run to the cap): most samples of a step are the same length and finish together, and the
step's 32 samples run at once, so there is little tail for APRIL to cut. Real RL
tasks answer in widely varying lengths (a short fact vs a long derivation). The model cannot
learn to vary its own length within a demo, so each row carries its answer budget instead, a
per-prompt cap on new tokens (the adapter's `max_tokens_column`, sent as the group's
`max_new_tokens`, the way a workload's per-member `max_new_tokens` sets a length): drawn from
a Pareto distribution (shape `BUDGET_SHAPE`, at least `BUDGET_MIN`), most prompts answer in a
few dozen tokens and about one in ten runs to the cap, so a step's rollout time is set by a
few long groups, the straggler pattern APRIL and background generation target. The budgets
use their own random stream, so prompts and answers are those of the budget-free task, and a
trainer that ignores the column (the TRL e2e test) sees the old task unchanged. A completion
cut at its budget is `truncated` and `digit_match` gives it nothing, like an over-long math
answer; the format reward is unaffected.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

FORMAT_CHARS = 16
BUDGET_COLUMN = "budget"
BUDGET_MIN = 16  # tokens: the shortest answer budget (digit_format reads 16 characters)
BUDGET_SHAPE = 1.0  # Pareto shape: P(budget > x) = BUDGET_MIN / x, so 1 in 10 above 10 x min
_DIGIT = re.compile(r"\d")


def dataset(size: int = 256, seed: int = 0, max_budget: int = 256) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    budgets = random.Random(f"budget:{seed}")  # its own stream: prompts do not depend on it
    rows: list[dict[str, Any]] = []
    for _ in range(size):
        digit, task = rng.randint(0, 9), rng.randint(0, 99)
        prompt = f"Task {task}: answer with the digit {digit}. Answer:"
        budget = min(max_budget, int(BUDGET_MIN * budgets.paretovariate(BUDGET_SHAPE)))
        rows.append({"prompt": prompt, "answer": str(digit), BUDGET_COLUMN: budget})
    return rows


def digit_format(completions: list[str], **_: Any) -> list[float | None]:
    return [sum(ch.isdigit() for ch in c[:FORMAT_CHARS]) / FORMAT_CHARS for c in completions]


def digit_match(
    completions: list[str], answer: list[str], april_status: list[str] | None = None, **_: Any
) -> list[float | None]:
    statuses = april_status or ["completed"] * len(completions)
    out: list[float | None] = []
    for text, want, status in zip(completions, answer, statuses, strict=True):
        found = _DIGIT.search(text)
        ok = status == "completed" and found is not None and found.group(0) == want
        out.append(1.0 if ok else 0.0)
    return out


REWARDS: list[Callable[..., list[float | None]]] = [digit_format, digit_match]
