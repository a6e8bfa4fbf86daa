"""The seeded agent workload of `april-bench --agent`: episodes of several turns, each turn ended
by the model emitting a turn stop token, each answered by a simulated tool.

Everything is a pure function of (seed, group index, member, turn), so `sync` and `april` draw
the same episodes whoever asks and when:
- turns per episode: the group's `max_turns`, lognormal with median `turns_p50` and 99th
  percentile `max_turns`, rounded and clipped to [1, max_turns] (long-tailed: most episodes are
  short, a few take every turn). An episode also ends earlier at EOS or at its token budget;
- tool latency of each answer: lognormal with median `tool_p50_s` and 99th percentile
  `tool_p99_s`, clipped to [0, 2 x tool_p99_s] (long-tailed, simulated on the client);
- the tool's answer: 2-8 token ids, none of them a turn stop or a special token.

How long a turn is comes from the model: it generates until it emits one of `turn_stop_ids`.
The defaults are the tiny model's six most frequent tokens at temperature 1 (about 10 % of its
samples together), so a turn is ~10 tokens on average, geometrically distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .workload import Z99

# The embedded tiny model's six most frequent tokens at temperature 1 (measured: 310 of 3200
# sampled tokens), so turns end after ~10 tokens on average.
TINY_TURN_STOPS = (370, 329, 34, 346, 270, 380)
ANSWER_LEN = (2, 8)  # tool answer length range (token ids), inclusive
FIRST_ID = 3  # skip the special tokens (ids 0-2 of the tiny model)
PROMPT_LEN = (8, 24)


def lognormal(rng: np.random.Generator, p50: float, p99: float) -> float:
    """One draw of the lognormal with median `p50` and 99th percentile `p99` (p99 >= p50 > 0)."""
    sigma = math.log(p99 / p50) / Z99 if p99 > p50 else 0.0
    return float(rng.lognormal(math.log(p50), sigma))


@dataclass(frozen=True)
class AgentSettings:
    n: int = 2
    max_tokens: int = 256  # budget of one episode: generated tokens over all its turns
    max_turns: int = 6
    turns_p50: float = 2.0
    tool_p50_s: float = 1.0
    tool_p99_s: float = 8.0
    turn_stop_ids: tuple[int, ...] = TINY_TURN_STOPS
    seed: int = 0
    vocab_size: int = 448

    def __post_init__(self) -> None:
        if self.max_turns < 1 or not 1 <= self.turns_p50 <= self.max_turns:
            raise ValueError("need 1 <= turns_p50 <= max_turns")
        if not 0 < self.tool_p50_s <= self.tool_p99_s:
            raise ValueError("need 0 < tool_p50_s <= tool_p99_s")
        if not self.turn_stop_ids:
            raise ValueError("need at least one turn stop token id")


@dataclass(frozen=True)
class AgentGroup:
    """One prompt group of `n` episodes that share the prompt and the turn limit."""

    index: int
    input_ids: tuple[int, ...]
    max_turns: int


class AgentWorkload:
    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings
        stops = set(settings.turn_stop_ids)
        self._plain = [t for t in range(FIRST_ID, settings.vocab_size) if t not in stops]

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.s.seed, *key])

    def group(self, index: int) -> AgentGroup:
        s = self.s
        rng = self._rng(index, 0)
        length = int(rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1))
        prompt = tuple(int(x) for x in rng.choice(self._plain, size=length))
        turns = round(lognormal(rng, s.turns_p50, s.max_turns))
        return AgentGroup(index, prompt, min(s.max_turns, max(1, turns)))

    def groups(self, start: int, count: int) -> list[AgentGroup]:
        return [self.group(i) for i in range(start, start + count)]

    def tool_latency(self, index: int, member: int, turn: int) -> float:
        """Seconds the tool takes to answer turn `turn` (1 = the first) of member `member`."""
        s = self.s
        rng = self._rng(index, 1, member, turn)
        return min(2 * s.tool_p99_s, lognormal(rng, s.tool_p50_s, s.tool_p99_s))

    def answer(self, index: int, member: int, turn: int) -> list[int]:
        """The tool's answer to turn `turn` of member `member` (token ids)."""
        rng = self._rng(index, 2, member, turn)
        length = int(rng.integers(ANSWER_LEN[0], ANSWER_LEN[1] + 1))
        return [int(x) for x in rng.choice(self._plain, size=length)]

    def turns(self, g: AgentGroup) -> dict[str, Any]:
        """The group's `turns` rule as the contract spells it."""
        return {"stop_token_ids": list(self.s.turn_stop_ids), "max_turns": g.max_turns}

    def sampling_params(self, temperature: float) -> dict[str, Any]:
        # No ignore_eos: SGLang then ignores stop token ids too, and turns could not end.
        return {"max_new_tokens": self.s.max_tokens, "temperature": temperature}

    def describe(self) -> str:
        s = self.s
        return (
            f"agent: turns/episode lognormal p50 {s.turns_p50:g}, p99 {s.max_turns} (clipped to "
            f"[1, {s.max_turns}]); tool latency lognormal p50 {s.tool_p50_s:g}s, p99 "
            f"{s.tool_p99_s:g}s; turn stops {list(s.turn_stop_ids)}; {s.n} episodes per group, "
            f"{s.max_tokens} generated tokens at most each; answers {ANSWER_LEN[0]}-"
            f"{ANSWER_LEN[1]} tokens"
        )
