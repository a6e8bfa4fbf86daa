"""How big a call's pool is: the running target a `max_inflight_groups: "auto"` call runs at,
decided per call from the engine's measured step curve (`rules/inflight.py`); how many groups
it keeps in progress beyond what its quota still needs, the pool that maximises fresh tokens
(`rules/goodput.py`: played from the step curve, the lengths seen, censored, and the call's
`max_staleness`); the admission bound every call shares (what fits beside what runs); and the
advice for the next call's pool (`stats.groups_wanted`). One part, built once by the root: the
newest decision is kept for the advice and for `/stats`, with what the calls then got."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from april_client.protocol import Group, RolloutReq
from april_server.engine.base import BaseEngine
from april_server.engine.versions import WeightVersions
from april_server.rules import samples as sample_rules
from april_server.rules.goodput import MIN_EXACT, CallShape, GoodputChoice, LengthCensus, choose
from april_server.rules.inflight import (
    Admission,
    InflightDecision,
    StepCurve,
    StepStat,
    choose_running_target,
)
from april_server.rules.lengths import LengthModel
from april_server.rules.pool_size import MAX_WANTED_PER_QUOTA, PUSH_MEMORY, PoolAdvisor

# Weight versions at the last calls' starts: pushes between any of the last PUSH_MEMORY pairs
# (the advice's memory of pushes, `rules/pool_size.py`).
VERSIONS_SEEN = PUSH_MEMORY + 1
GOODPUT_SEEN = 10  # calls the measured goodput is summed over


@dataclass(frozen=True, slots=True)
class CallPool:
    """What an "auto" call runs at: its running target, and the groups in progress it may
    keep beyond what its quota still needs: what the goodput play chose; before there is
    length evidence, none under a `max_staleness` (`unplayed_bound`: what it would carry over
    could only age toward the bound, by amounts nobody can weigh yet), else as many as it
    holds, within the running target (None)."""

    decision: InflightDecision
    goodput: GoodputChoice | None = None
    unplayed_bound: bool = False

    @property
    def extra_groups(self) -> int | None:
        if self.goodput is not None:
            return self.goodput.extra
        return 0 if self.unplayed_bound else None


class PoolSizing:
    def __init__(
        self,
        engine: BaseEngine,
        admission: Admission,
        lengths: LengthModel,
        versions: WeightVersions | None = None,
        census: LengthCensus | None = None,
    ) -> None:
        """`admission`: the bound every call and the background share (sized by the segment
        planner from the engine's capacity); `lengths`: what buffered groups have left, and the
        recent finished lengths the advice plays fresh groups at; `versions`: how stale the
        tokens a call delivers are (the goodput it got); `census`: the lengths seen, shared
        with the weight cut, which records the samples a push cuts."""
        self.engine = engine
        self.admission = admission
        self.lengths = lengths
        self.versions = versions
        self.advisor = PoolAdvisor()  # across calls: it plays from the lengths seen
        self.last: tuple[InflightDecision, StepCurve, Mapping[int, float | StepStat]] | None = None
        # The lengths the goodput play draws from.
        self.census = LengthCensus() if census is None else census
        self.pool: CallPool | None = None  # the newest "auto" call's pool
        self.started_at: deque[str] = deque(maxlen=VERSIONS_SEEN)
        # (tokens delivered within max_staleness, wall s) of the last calls that were sized
        self.got: deque[tuple[int, float]] = deque(maxlen=GOODPUT_SEEN)

    async def decide(
        self,
        demand: int,
        cap: int,
        target_groups: int | None = None,
        group_size: int | None = None,
        max_staleness: int | None = None,
        single_turn: bool = False,
    ) -> CallPool:
        """The running target for a call that would run `demand` samples synchronously and can
        run at most `cap`; given its quota's shape, also the groups it may keep in progress
        beyond what the quota still needs, played for goodput within `max_staleness`.
        `single_turn`: the call holds single-turn groups only, whose finished samples give
        the lengths a play needs."""
        raw = await self.engine.step_curve()
        curve = StepCurve.smoothed(raw)
        decision = choose_running_target(curve, demand, cap)
        self.last = (decision, curve, raw)
        if self.versions is not None:
            self.started_at.append(self.versions.now())
        if not target_groups or not group_size:
            self.pool = CallPool(decision)
            return self.pool
        fit = self.census.fit()
        if fit is None or len(curve.points) < 2:
            # No play yet. Lengths unknown, under a staleness bound: the synchronous trainer's
            # pool (it throws nothing away and carries nothing over) until its own finished
            # samples make them known. Otherwise (no bound: nothing ages; a thin step curve;
            # agent episodes, whose lengths are not counted) all it holds.
            bounded = fit is None and max_staleness is not None and single_turn
            if bounded:
                reason = decision.reason + "; no group beyond the quota in progress until "
                reason += f"{MIN_EXACT} samples have finished (max_staleness {max_staleness})"
                decision = InflightDecision(decision.running_target, reason)
                self.last = (decision, curve, raw)
            self.pool = CallPool(decision, unplayed_bound=bounded)
            return self.pool
        # Unknown until two calls were seen: as if pushed (the cautious case under a bound).
        seen = list(self.started_at)
        pushes = len(seen) < 2 or any(a != b for a, b in zip(seen, seen[1:], strict=False))
        clock = await self.engine.engine_clock()
        tokens = clock.get("prefill_tokens", 0.0)
        shape = CallShape(
            target_groups,
            group_size,
            decision.running_target,
            max_staleness,
            pushes,
            clock.get("prefill_s", 0.0) / tokens if tokens else 0.0,
            self.census.prompt_tokens,
        )
        fits = self.admission.max_samples // group_size - target_groups
        most = max(0, min((MAX_WANTED_PER_QUOTA - 1) * target_groups, fits))
        # Pure but not free (a few ms to tens of ms): off the event loop.
        chosen = await asyncio.to_thread(
            choose, curve.step_time, fit, shape, most, self.admission.max_samples
        )
        sized = InflightDecision(max(chosen.running_target, demand), chosen.reason)
        self.last = (sized, curve, raw)
        self.pool = CallPool(sized, chosen)
        return self.pool

    def observe(
        self,
        req: RolloutReq,
        held: Sequence[Group],
        delivered: Sequence[Group] | None,
        wall_s: float,
    ) -> int | None:
        """After a call: its samples' lengths (finished exact, the rest censored at what they
        made) for the next plays; for an "auto" call that delivered (`delivered` not None),
        the tokens it delivered within its `max_staleness` (what it got, beside what was
        expected). Returns those tokens."""
        for g in held:
            for s in g.samples:
                self.census.record_sample(s, len(s.output_ids), sample_rules.is_finished(s))
        if req.max_inflight_groups != "auto" or self.versions is None or delivered is None:
            return None
        now, history, m = self.versions.now(), self.versions.history, req.max_staleness
        fresh = sum(
            seg.end - seg.start
            for g in delivered
            for s in g.samples
            for seg in s.segments
            if m is None or sample_rules.version_lag(seg.weight_version, now, history) <= m
        )
        self.got.append((fresh, wall_s))
        return fresh

    def groups_wanted(
        self, req: RolloutReq, held: Sequence[Group], buffered: Sequence[Group], version: str
    ) -> int | None:
        """The advice for the next call: at the running target the engine's step curve picks
        for this call's quota (with no cap from what was sent), how many groups to hold so that
        the batch stays filled until the quota is met. Only for `max_inflight_groups: "auto"`
        (a pinned number sets its own batch). `held`: every group of the call; `buffered`: those
        it left in the buffer."""
        curve = None if self.last is None else self.last[1]  # this call's, or a later one's
        if req.max_inflight_groups != "auto" or curve is None or not held:
            return None
        choice = None if self.pool is None else self.pool.goodput
        if choice is not None:
            # The pool the goodput play chose: the quota and its extra groups in progress.
            return max(req.target_groups + choice.extra, len(buffered))
        size = round(sum(len(g.samples) for g in held) / len(held))
        target = choose_running_target(curve, req.target_groups * size, self.admission.max_samples)
        return self.advisor.advise(
            req.target_groups,
            target.running_target,
            version,
            [self.lengths.remaining(g) for g in buffered],
            list(self.lengths.recent),
            size,
            req.max_staleness,
        )

    def forget(self) -> None:
        """The lengths the advice played from were forgotten (`DELETE /lengths`)."""
        self.advisor.forget()
        self.census.forget()
        self.pool = None
        self.got.clear()
        self.started_at.clear()

    def stats(self) -> dict[str, Any]:
        if self.last is None:
            return {"last_target": None}
        decision, curve, raw = self.last
        measured = {
            str(b): [m.steps, round(m.mean_s, 6), round(m.std_s, 6), round(m.mean_context, 1)]
            for b, m in sorted(raw.items())
            if isinstance(m, StepStat)
        }
        context = curve.context
        return {
            "last_target": decision.running_target,
            "reason": decision.reason,
            **self.goodput_stats(),
            # What the decision used: at a common context, smoothed, thinly measured sizes
            # credited with the doubt.
            "step_time_s_by_batch": {str(b): round(t, 6) for b, t in sorted(curve.points.items())},
            # What the scheduler measured: [decode steps, mean s, std s, mean context tokens].
            "measured_by_batch": measured,
            "context_cost_s_per_token": None if context is None else context.cost_per_token_s,
            "context_per_sample": None if context is None else round(context.context_per_sample, 1),
        }

    def goodput_stats(self) -> dict[str, Any]:
        """The newest pool's choice, what it expected, and what the last calls got."""
        pool, fit = self.pool, self.census.fit()
        choice = None if pool is None else pool.goodput
        tokens, wall = sum(t for t, _ in self.got), sum(w for _, w in self.got)
        return {
            "extra_groups": None if pool is None else pool.extra_groups,
            "goodput": None
            if choice is None
            else {
                "expected_tok_s": round(choice.expected.goodput, 3),
                "expected_thrown_share": round(choice.expected.thrown_share, 4),
                "sync_expected_tok_s": round(choice.sync.goodput, 3),
                "reason": choice.reason,
            },
            "goodput_measured_tok_s": round(tokens / wall, 3) if wall > 0 else None,
            "goodput_measured_calls": len(self.got),
            "length_fit": None
            if fit is None
            else {
                "finished": fit.exact,
                "cut": fit.censored,
                "mean": round(fit.mean, 1),
                "p50": fit.quantile(0.5),
                "p90": fit.quantile(0.9),
                "p99": fit.quantile(0.99),
            },
        }
