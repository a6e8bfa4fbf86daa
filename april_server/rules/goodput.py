"""How many groups a call keeps in progress (`max_inflight_groups: "auto"`): the pool that
maximises fresh tokens. Pure Python.

What a trainer can use is not raw tokens per second but tokens that arrive within its
staleness bound: a group started in one call and carried into later ones is consumed older
by one version for every weight push in between, and once its oldest token would be more than
the call's `max_staleness` behind, its members restart from their prompts and what they made
is thrown away. Over-provisioning fills the engine (the step curve's throughput `b / t(b)`
rises with the running batch) but every group in progress when the quota is met carries over.
So the call's lever is how many groups it keeps in progress beyond what its quota still needs:
`extra` E. A group may start while the call's groups in progress number fewer than the
quota's remaining groups plus E; so a call ends with at most E groups carried over. E = 0 is
the synchronous trainer (the quota's groups, waited for to the last); a large E is APRIL's
static over-provisioning, bounded by the running target (`rules/inflight.py`).

The choice plays the calls forward for each candidate E, with what the server measured:

- the step curve (`StepCurve`): seconds per decode step at each running batch;
- the length distribution (`LengthFit`): Kaplan-Meier over the samples seen lately, finished
  ones exact, unfinished ones censored at what they had generated (a sample cut at the quota's
  end or restarted is *at least* that long: without this the fit would know mostly the short
  ones, which finish first);
- the call's shape: quota (groups, group size), running target, `max_staleness`, whether
  weights are pushed between calls (without pushes nothing ages), and the re-prefill a carried
  member pays after a push.

A play (`play`) runs calls as the server does: carried groups first (oldest first), each
member judged at the call's start (one whose oldest token is more than `max_staleness`
versions behind restarts: what it made is thrown away), then new groups; groups start whole
under the rule above and the running target; every running sample makes one token per decode
step, a step costing `t(running)`; the call ends once its quota of groups has finished, and
what runs carries over. Its goodput is what was generated and not thrown away per second over
the calls after a warm-up (in the steady state that is what gets consumed). `choose` picks the
smallest E within `GOODPUT_EPS` of the best among the pools expected to throw away at most
`THROWN_MAX` of what they generate, and reports the synchronous trainer's goodput beside it
(E = 0 is always a candidate and throws nothing away, so the model never prefers a pool it
expects to do worse than sync). The cap is there because thrown tokens are engine time the
trainer paid for and lost, and a pool that throws much away is the one whose goodput rests
most on the tail of the fit, the part it knows least. Draws are deterministic (stratified
quantiles in a fixed shuffled order): the same evidence gives the same choice.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from april_client.protocol import Sample

GOODPUT_EPS = 0.02  # "the best" means within 2 %: the smaller target carries less over
THROWN_MAX = 0.05  # a pool expected to throw away more of what it generates is not chosen
PLAY_CALLS = 10  # calls played per candidate ...
WARM_CALLS = 3  # ... of which the first are the warm-up (a cold start carries nothing)
DRAWS = 512  # stratified length draws a play cycles through
# Extra groups played, as shares of the quota (0 = sync is always played too).
EXTRA_SHARES = (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
MIN_EXACT = 8  # finished samples needed before the fit is trusted
CENSUS_SIZE = 2048  # samples the fit remembers, the newest seen


@dataclass(frozen=True, slots=True)
class LengthFit:
    """A length distribution from right-censored observations (Kaplan-Meier): `values`
    ascending, `cum` the cumulative probability at each. Mass the observations cannot place
    (every sample longer than the largest finished one was cut) sits at `tail`, the longest
    budget seen: a sample that never finished runs at least that long as far as a play goes."""

    values: tuple[float, ...]
    cum: tuple[float, ...]
    exact: int
    censored: int

    @classmethod
    def fit(cls, exact: Sequence[int], censored: Sequence[int], tail: int = 0) -> LengthFit | None:
        """None with fewer than `MIN_EXACT` finished lengths (no evidence yet)."""
        if len(exact) < MIN_EXACT:
            return None
        events = sorted([(max(1, x), 0) for x in exact] + [(max(1, c), 1) for c in censored])
        at_risk = len(events)
        survival = 1.0
        values: list[float] = []
        cum: list[float] = []
        i = 0
        while i < len(events):
            x = events[i][0]
            deaths = cut = 0
            while i < len(events) and events[i][0] == x:
                deaths += events[i][1] == 0
                cut += events[i][1] == 1
                i += 1
            if deaths:
                survival *= 1.0 - deaths / at_risk
                values.append(float(x))
                cum.append(1.0 - survival)
            at_risk -= deaths + cut
        if survival > 1e-9:  # the censored tail: longer than anything seen to finish
            values.append(float(max(tail, int(values[-1]) + 1, max(censored, default=0))))
            cum.append(1.0)
        cum[-1] = 1.0
        return cls(tuple(values), tuple(cum), len(exact), len(censored))

    def quantile(self, q: float) -> float:
        return self.values[min(bisect_left(self.cum, q), len(self.values) - 1)]

    @property
    def mean(self) -> float:
        prev, total = 0.0, 0.0
        for v, c in zip(self.values, self.cum, strict=True):
            total += v * (c - prev)
            prev = c
        return total

    def draws(self, k: int = DRAWS) -> list[int]:
        """`k` stratified draws in a fixed shuffled order (deterministic)."""
        out = [max(1, round(self.quantile((i + 0.5) / k))) for i in range(k)]
        random.Random(k).shuffle(out)
        return out


class LengthCensus:
    """The newest samples seen at the end of calls, by id: a finished one's length (exact), an
    unfinished one's tokens so far (censored: it is at least that long). A sample seen again
    keeps the most it was ever seen to have (restarted from its prompt, it is still at least
    as long as it got before, as far as the fit goes)."""

    def __init__(self, size: int = CENSUS_SIZE) -> None:
        self.size = size
        self.seen: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        self.longest_budget = 0
        self.prompt_tokens = 0.0  # mean prompt length of what was recorded
        self._prompts = 0
        # The fit of what is seen now, until a record or a forget changes it: /stats and every
        # "auto" call read it on the event loop, and it sorts the whole census.
        self._fit: tuple[LengthFit | None] | None = None

    def record(
        self, sample_id: str, tokens: int, finished: bool, budget: int, prompt_len: int
    ) -> None:
        old = self.seen.pop(sample_id, None)
        if finished:
            entry = (tokens, True)
        elif tokens <= 0 and old is None:
            return  # never started: no evidence
        else:
            entry = (max(tokens, 0 if old is None or old[1] else old[0]), False)
        self.seen[sample_id] = entry
        while len(self.seen) > self.size:
            self.seen.popitem(last=False)
        self.longest_budget = max(self.longest_budget, budget)
        self._prompts += 1
        self.prompt_tokens += (prompt_len - self.prompt_tokens) / self._prompts
        self._fit = None

    def record_sample(self, sample: Sample, tokens: int, finished: bool) -> None:
        """`sample` seen with `tokens` (its length if `finished`, else at least that). An
        agent episode is not counted: its length is its tools' as much as its own."""
        if sample.turn_rule is None:
            self.record(
                sample.sample_id, tokens, finished, sample.max_new_tokens, len(sample.prompt_ids)
            )

    def fit(self) -> LengthFit | None:
        if self._fit is None:
            exact = [x for x, done in self.seen.values() if done]
            cut = [x for x, done in self.seen.values() if not done and x > 0]
            self._fit = (LengthFit.fit(exact, cut, self.longest_budget),)
        return self._fit[0]

    def forget(self) -> None:
        self.seen.clear()
        self.longest_budget = 0
        self.prompt_tokens, self._prompts = 0.0, 0
        self._fit = None


@dataclass(frozen=True, slots=True)
class CallShape:
    target_groups: int  # K: groups a call consumes
    group_size: int  # n
    running_target: int  # samples generating at once at most
    max_staleness: int | None
    pushes: bool  # a weight push between calls: each carried call ages a group one version
    prefill_s_per_token: float = 0.0  # re-prefill of a carried member's context after a push
    prompt_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Play:
    extra: int  # groups in progress allowed beyond what the quota still needs
    goodput: float  # tokens generated and not thrown away, per second
    throughput: float  # generated tokens per second
    thrown_share: float  # of the generated tokens, thrown away by staleness restarts
    carried: float  # groups carried into the next call, on average


StepTime = Callable[[int], float]


class _Member:
    __slots__ = ("done", "left", "length", "oldest")

    def __init__(self, length: int) -> None:
        self.length, self.left, self.done = length, length, 0
        self.oldest: int | None = None  # the call its oldest kept token was made in


def play(step_time: StepTime, lengths: Sequence[int], shape: CallShape, extra: int) -> Play:
    """Calls played forward with `extra` groups in progress allowed (module doc). `lengths`:
    the draws new members cycle through. A running member's tokens are read off the step it
    ends at (it makes one per step), so an event costs a heap operation, not a pass over the
    batch."""
    k, n, m = shape.target_groups, shape.group_size, shape.max_staleness
    draw = _cycle(lengths)
    queue: list[list[_Member]] = []  # groups not yet consumed, oldest first
    seconds = generated = thrown = carried = 0.0
    measured = 0
    for call in range(PLAY_CALLS):
        version = call if shape.pushes else 0
        # The client holds what the call may start: the quota and the extra, at least.
        queue += [[_Member(next(draw)) for _ in range(n)] for _ in range(k + extra - len(queue))]
        lost = 0
        for group in queue:  # judged at the call's start: the staleness bound first
            for mb in group:
                if mb.oldest is not None and m is not None and version - mb.oldest > m:
                    lost += mb.done
                    mb.left, mb.done, mb.oldest = mb.length, 0, None
        run = _Call(queue, step_time, shape, extra, version)
        run.admit()
        while len(run.finished) < k and run.ends:
            run.advance()
        taken = set(run.stop())
        queue = [g for gi, g in enumerate(queue) if gi not in taken]
        if call >= WARM_CALLS:
            measured += 1
            seconds += run.seconds
            generated += run.generated
            thrown += lost
            carried += sum(1 for g in queue if any(mb.done for mb in g))
    return Play(
        extra,
        (generated - thrown) / seconds if seconds > 0 else 0.0,
        generated / seconds if seconds > 0 else 0.0,
        thrown / generated if generated > 0 else 0.0,
        carried / max(1, measured),
    )


class _Call:
    """One played call over the held groups `queue` (oldest first)."""

    def __init__(
        self,
        queue: list[list[_Member]],
        step_time: StepTime,
        shape: CallShape,
        extra: int,
        version: int,
    ) -> None:
        self.queue, self.step_time, self.shape = queue, step_time, shape
        self.extra, self.version = extra, version
        self.finished: list[int] = []
        self.ends: list[tuple[int, int, int]] = []  # (step it ends at, group, member)
        self.open: dict[int, int] = {}  # group -> members still running
        self.running = self.step = self.next = 0
        self.seconds = 0.0
        self.generated = 0

    def admit(self) -> None:
        """Whole groups in order while fewer than the quota's remaining groups plus `extra`
        are in progress and the running samples stay within the target (the first always)."""
        shape, k = self.shape, self.shape.target_groups
        while self.next < len(self.queue) and len(self.finished) < k:
            gi, group = self.next, self.queue[self.next]
            open_ = [j for j, mb in enumerate(group) if mb.left > 0]
            if open_ and len(self.open) >= k - len(self.finished) + self.extra:
                return
            if self.running and self.running + len(open_) > shape.running_target:
                return
            self.next += 1
            if not open_:  # finished before: it counts at once
                self.finished.append(gi)
                continue
            self.open[gi] = len(open_)
            for j in open_:
                mb = group[j]
                if mb.done and shape.pushes:  # its KV is of older weights: re-prefilled
                    self.seconds += shape.prefill_s_per_token * (shape.prompt_tokens + mb.done)
                if mb.oldest is None:  # it makes a token before the call can end
                    mb.oldest = self.version
                heapq.heappush(self.ends, (self.step + mb.left, gi, j))
                self.running += 1

    def advance(self) -> None:
        """To the next step a member ends at; the groups that end there count."""
        upto = self.ends[0][0]
        self.seconds += (upto - self.step) * self.step_time(self.running)
        self.generated += (upto - self.step) * self.running
        self.step = upto
        while self.ends and self.ends[0][0] == upto:
            _, gi, j = heapq.heappop(self.ends)
            self.running -= 1
            mb = self.queue[gi][j]
            mb.left, mb.done = 0, mb.length
            self.open[gi] -= 1
            if not self.open[gi]:
                del self.open[gi]
                self.finished.append(gi)
        self.admit()

    def stop(self) -> list[int]:
        """The quota is met (or out of reach): what runs stops with its tokens; the groups
        consumed."""
        for end, gi, j in self.ends:
            mb = self.queue[gi][j]
            mb.left = end - self.step
            mb.done = mb.length - mb.left
        self.ends = []
        return self.finished[: self.shape.target_groups]


def _cycle(values: Sequence[int]) -> Iterator[int]:
    while True:
        yield from values


def play_sync(step_time: StepTime, lengths: Sequence[int], shape: CallShape) -> Play:
    """A synchronous trainer: the quota's groups all at once, waited for to the last."""
    return play(step_time, lengths, dataclasses.replace(shape, running_target=1 << 30), 0)


@dataclass(frozen=True, slots=True)
class GoodputChoice:
    running_target: int
    expected: Play
    sync: Play
    reason: str

    @property
    def extra(self) -> int:
        """The extra groups chosen: the expected play's."""
        return self.expected.extra


def candidates(target_groups: int, most: int) -> list[int]:
    """Extra groups worth playing: 0 (sync), then a growing share of the quota, up to `most`."""
    out = {0, most}
    for share in EXTRA_SHARES:
        out.add(min(most, max(1, round(share * target_groups))))
    return sorted(x for x in out if 0 <= x <= most)


def choose(
    step_time: StepTime, fit: LengthFit, shape: CallShape, most: int, max_running: int = 1 << 30
) -> GoodputChoice:
    """The extra groups (in `[0, most]`) and running target with the best goodput among the
    pools expected to throw away at most `THROWN_MAX`: the fewest extra groups, then the
    smaller target, within `GOODPUT_EPS` of it (fewer carry less over).
    Each pool is played at the call's running target (the step curve's knee,
    `shape.running_target`) and at every sample it keeps in progress running (up to
    `max_running`), since the knee is of raw throughput and a bigger batch may finish groups
    sooner."""
    lengths = fit.draws()
    k, n = shape.target_groups, shape.group_size
    plays: list[tuple[Play, int]] = []
    for e in candidates(k, most):
        for b in sorted(
            {shape.running_target, max(shape.running_target, min(max_running, (k + e) * n))}
        ):
            trial = dataclasses.replace(shape, running_target=b)
            plays.append((play(step_time, lengths, trial, e), b))
    # No extra group throws nothing away (nothing is carried over): one always stays.
    kept = [(p, b) for p, b in plays if p.thrown_share <= THROWN_MAX]
    best = max(p.goodput for p, _ in kept)
    chosen, target = next((p, b) for p, b in kept if p.goodput >= (1 - GOODPUT_EPS) * best)
    sync = play_sync(step_time, lengths, shape)
    limit = (
        "no staleness bound"
        if shape.max_staleness is None
        else f"max_staleness {shape.max_staleness}"
    )
    reason = (
        f"goodput {chosen.goodput:.1f} tok/s ({limit}, "
        f"{'a push between calls' if shape.pushes else 'no push seen between calls'}) with "
        f"{chosen.extra} groups beyond the quota in progress and {target} samples running, "
        f"{chosen.thrown_share:.1%} thrown away; sync {sync.goodput:.1f}; {len(kept)} of "
        f"{len(plays)} pools played within {THROWN_MAX:.0%} thrown away, from {fit.exact} "
        f"finished and {fit.censored} cut lengths (mean {fit.mean:.0f})"
    )
    return GoodputChoice(target, chosen, sync, reason)
