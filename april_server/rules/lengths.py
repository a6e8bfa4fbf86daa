"""Predicted response lengths: who will run long, from what the server already saw.

Two kinds of evidence, both free to a rollout server:
- a group's finished siblings (same prompt, same weights, same moment: Seer's signal);
- the same prompt's earlier rollouts (RL epochs revisit prompts), kept per prompt by its tokens.

A sample that has already generated `g` tokens is not one of the observations shorter than `g`,
so the prediction is the weighted median of the observations *longer* than it (survival), and a
sample that outlived them all is predicted at its budget. Pure Python, no I/O.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from april_client.protocol import Group, Sample
from april_server.settings.config import LengthOrder, Placement

HISTORY_PER_PROMPT = 32  # newest lengths kept per prompt
MAX_PROMPTS = 200_000  # prompts remembered; the least recently seen are forgotten first
SIBLING_WEIGHT = 2.0  # a sibling counts as two earlier rollouts (same weights, same moment)
EVIDENCE_HALF = 2.0  # confidence is w / (w + EVIDENCE_HALF) x agreement
OUTLIVED_CONFIDENCE = 0.25  # longer than every observation: "at its budget", weakly held
RECENT_LENGTHS = 1024  # lengths last seen to finish: what a fresh sample is played at

Basis = Literal["siblings", "history", "both", "outlived"]


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """The history's key: a digest of the prompt's token ids (12 bytes: no practical clash)."""
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class Prediction:
    total: int  # output tokens the sample will have when it finishes
    remaining: int  # total - generated so far (>= 1 while it runs)
    confidence: float  # 0..1: how much evidence, and how well it agrees
    basis: Basis


class Evidence:
    """A group's observations, sorted once with prefix sums, so each member's prediction costs
    a binary search (a `/partials` page predicts every unfinished member it lists, on the event
    loop)."""

    __slots__ = ("basis", "cum_w", "cum_wx", "cum_wxx", "xs")

    def __init__(self, siblings: Sequence[int], history: Sequence[int]) -> None:
        obs = sorted([(x, SIBLING_WEIGHT) for x in siblings] + [(x, 1.0) for x in history])
        self.xs = [x for x, _ in obs]
        self.cum_w, self.cum_wx, self.cum_wxx = [0.0], [0.0], [0.0]
        for x, w in obs:
            self.cum_w.append(self.cum_w[-1] + w)
            self.cum_wx.append(self.cum_wx[-1] + w * x)
            self.cum_wxx.append(self.cum_wxx[-1] + w * x * x)
        self.basis: Basis = (
            "both" if siblings and history else "siblings" if siblings else "history"
        )

    def predict(self, generated: int, budget: int) -> Prediction | None:
        if not self.xs:
            return None
        lo = bisect_right(self.xs, generated)  # observations longer than what it generated
        if lo == len(self.xs):  # it outlived every observation: it is in the tail
            total = max(budget, generated + 1)
            return Prediction(total, total - generated, OUTLIVED_CONFIDENCE, "outlived")
        cw = self.cum_w
        weight = cw[-1] - cw[lo]
        # The weighted median of the survivors: the first whose cumulative weight reaches half.
        k = bisect_left(cw, cw[lo] + weight / 2, lo + 1) - 1
        median = self.xs[min(k, len(self.xs) - 1)]
        total = min(max(median, generated + 1), max(budget, generated + 1))
        mean = (self.cum_wx[-1] - self.cum_wx[lo]) / weight
        var = max((self.cum_wxx[-1] - self.cum_wxx[lo]) / weight - mean * mean, 0.0)
        agreement = 1.0 / (1.0 + math.sqrt(var) / mean)  # 1 / (1 + coefficient of variation)
        confidence = weight / (weight + EVIDENCE_HALF) * agreement
        return Prediction(total, total - generated, round(confidence, 3), self.basis)


def predict(
    generated: int, budget: int, siblings: Sequence[int], history: Sequence[int]
) -> Prediction | None:
    """The predicted final output length of a sample with `generated` tokens and a total
    budget of `budget` (max_new_tokens), from its finished siblings' and the prompt's earlier
    lengths. None: no evidence."""
    return Evidence(siblings, history).predict(generated, budget)


def finished_length(sample: Sample) -> int | None:
    """The length a finished single-turn sample contributes as evidence (None: it does not:
    unfinished, or an agent episode whose length is its tools' as much as the model's)."""
    if sample.status not in ("completed", "truncated") or sample.turn_rule is not None:
        return None
    return len(sample.output_ids)


@dataclass
class PredictionScore:
    """Predicted vs actual final length, over the samples that finished with a prediction."""

    scored: int = 0
    abs_error: int = 0  # sum of |predicted - actual| tokens
    signed_error: int = 0  # sum of (predicted - actual): > 0 predicts too long
    rel_abs_error: float = 0.0  # sum of |predicted - actual| / actual

    def add(self, predicted: int, actual: int) -> None:
        self.scored += 1
        self.abs_error += abs(predicted - actual)
        self.signed_error += predicted - actual
        self.rel_abs_error += abs(predicted - actual) / max(actual, 1)

    def figures(self) -> dict[str, float | int]:
        n = max(self.scored, 1)
        return {
            "scored_samples": self.scored,
            "abs_error_tokens": self.abs_error,
            "error_tokens": self.signed_error,
            "abs_rel_error": round(self.rel_abs_error, 4),
            "mean_abs_error_tokens": round(self.abs_error / n, 2),
            "mean_error_tokens": round(self.signed_error / n, 2),
            "mean_abs_rel_error": round(self.rel_abs_error / n, 4),
        }


@dataclass
class LengthHistory:
    """The newest `HISTORY_PER_PROMPT` finished lengths of each prompt, for `MAX_PROMPTS`
    prompts (least recently seen forgotten first). `dirty` names the prompts changed since the
    store last saved them."""

    per_prompt: int = HISTORY_PER_PROMPT
    max_prompts: int = MAX_PROMPTS
    _lengths: OrderedDict[str, deque[int]] = field(default_factory=OrderedDict)
    dirty: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self._lengths)

    def get(self, key: str) -> Sequence[int]:
        return self._lengths.get(key, ())

    def add(self, key: str, length: int) -> None:
        q = self._lengths.get(key)
        if q is None:
            q = self._lengths[key] = deque(maxlen=self.per_prompt)
            while len(self._lengths) > self.max_prompts:
                old, _ = self._lengths.popitem(last=False)
                self.dirty.discard(old)
        else:
            self._lengths.move_to_end(key)
        q.append(length)
        self.dirty.add(key)

    def load(self, rows: Iterable[tuple[str, Sequence[int]]]) -> None:
        for key, lengths in rows:
            for x in lengths:
                self.add(key, int(x))
        self.dirty.clear()

    def take_dirty(self) -> list[tuple[str, list[int]]]:
        out = [(k, list(self._lengths[k])) for k in self.dirty if k in self._lengths]
        self.dirty.clear()
        return out

    def forget(self) -> int:
        n = len(self._lengths)
        self._lengths.clear()
        self.dirty.clear()
        return n


class LengthModel:
    """The server's length predictions: the history, the score, and the per-sample rule."""

    def __init__(
        self,
        history: LengthHistory | None = None,
        default_order: LengthOrder = "arrival",  # --april-length-order
        placement: Placement = "least_loaded",  # --april-placement (rules/placement.py)
    ) -> None:
        self.history = history if history is not None else LengthHistory()
        self.default_order = default_order
        self.placement = placement
        self.score = PredictionScore()
        self.forgotten = 0  # prompts dropped by `forget` (DELETE /lengths)
        # Every finished length seen (count, sum): the prior for a sample without evidence.
        self.finished_count = 0
        self.finished_sum = 0
        # The newest finished lengths, in finishing order (rules/pool_size.py plays fresh
        # groups at them). Every sample ends (completed, or truncated at its budget), so over
        # a few calls this is the distribution, the tail included.
        self.recent: deque[int] = deque(maxlen=RECENT_LENGTHS)

    def evidence(self, group: Group) -> Evidence:
        """What the group's unfinished members are predicted from: its finished members and
        its prompt's history (the same for every member: a member is never its own evidence,
        since only finished ones are)."""
        siblings = [x for s in group.samples if (x := finished_length(s)) is not None]
        prompt = group.samples[0].prompt_ids if group.samples else []
        return Evidence(siblings, self.history.get(prompt_key(prompt)))

    def _predictions(self, group: Group) -> list[tuple[Sample, Prediction | None]]:
        """Each unfinished member with its prediction (None: no evidence, or an agent
        episode)."""
        open_ = [s for s in group.samples if s.status not in ("completed", "truncated")]
        if not open_:
            return []
        ev = self.evidence(group)
        return [
            (
                s,
                None
                if s.turn_rule is not None
                else ev.predict(len(s.output_ids), s.max_new_tokens),
            )
            for s in open_
        ]

    def mark(self, group: Group) -> None:
        """Write each unfinished member's prediction on it (what `/partials` shows and what
        the score is later taken on)."""
        for s, p in self._predictions(group):
            s.predicted_tokens = None if p is None else p.total
            s.predicted_remaining = None if p is None else p.remaining
            s.prediction_confidence = None if p is None else p.confidence

    def finished(self, sample: Sample) -> None:
        """A sample ended: score the prediction it ran under, add its length to the history."""
        length = finished_length(sample)
        if length is None:
            return
        if sample.predicted_tokens is not None:
            self.score.add(sample.predicted_tokens, length)
        sample.predicted_remaining = 0 if sample.predicted_tokens is not None else None
        self.history.add(prompt_key(sample.prompt_ids), length)
        self.finished_count += 1
        self.finished_sum += length
        self.recent.append(length)

    @property
    def prior(self) -> float:
        """The mean finished length so far (0 before any finished): what a sample without
        evidence is taken to run, for ordering only. Deliberately not its budget: a budget set
        per member (a replayed length distribution) would be the client's own answer."""
        return self.finished_sum / self.finished_count if self.finished_count else 0.0

    def remaining(self, group: Group) -> list[float]:
        """Each unfinished member's predicted remaining tokens (a member without evidence:
        the prior, less what it generated)."""
        return [
            float(p.remaining) if p is not None else max(self.prior - len(s.output_ids), 0.0)
            for s, p in self._predictions(group)
        ]

    def group_remaining(self, group: Group) -> float:
        """How long the group will still run: its longest member's predicted remaining."""
        return max(self.remaining(group), default=0.0)

    def order(self, groups: Sequence[Group], policy: LengthOrder) -> list[Group]:
        """`groups` in the order a call should start them (stable: ties keep arrival order)."""
        if policy == "arrival":
            return list(groups)
        sign = -1.0 if policy == "longest_first" else 1.0
        keyed = [(sign * self.group_remaining(g), i, g) for i, g in enumerate(groups)]
        return [g for _, _, g in sorted(keyed, key=lambda t: (t[0], t[1]))]

    def forget(self) -> int:
        """Forget every prompt's history and the recent lengths (`DELETE /april/v1/lengths`);
        the score stays."""
        n = self.history.forget()
        self.recent.clear()
        self.forgotten += n
        return n

    def figures(self) -> dict[str, float | int | str]:
        return {
            **self.score.figures(),
            "default_order": self.default_order,
            "placement": self.placement,
            "history_prompts": len(self.history),
            "prior_tokens": round(self.prior, 1),
            "history_forgotten_prompts": self.forgotten,
        }
