"""How big a call's pool is: the running target a `max_inflight_groups: "auto"` call runs at,
decided per call from the engine's measured step curve (`rules/inflight.py`); the admission
bound every call shares (what fits beside what runs); and the advice for the next call's pool
(`stats.groups_wanted`, `rules/pool_size.py`), played from the newest decision's curve and the
lengths seen. One part, built once by the root: the newest decision is kept for the advice and
for `/stats`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from april_client.protocol import Group, RolloutReq
from april_server.engine.base import BaseEngine
from april_server.rules.inflight import (
    Admission,
    InflightDecision,
    StepCurve,
    StepStat,
    choose_running_target,
)
from april_server.rules.lengths import LengthModel
from april_server.rules.pool_size import PoolAdvisor


class PoolSizing:
    def __init__(self, engine: BaseEngine, admission: Admission, lengths: LengthModel) -> None:
        """`admission`: the bound every call and the background share (sized by the segment
        planner from the engine's capacity); `lengths`: what buffered groups have left, and the
        recent finished lengths the advice plays fresh groups at."""
        self.engine = engine
        self.admission = admission
        self.lengths = lengths
        self.advisor = PoolAdvisor()  # across calls: it plays from the lengths seen
        self.last: tuple[InflightDecision, StepCurve, Mapping[int, float | StepStat]] | None = None

    async def decide(self, demand: int, cap: int) -> InflightDecision:
        """The running target for a call that would run `demand` samples synchronously and can
        run at most `cap`."""
        raw = await self.engine.step_curve()
        curve = StepCurve.smoothed(raw)
        decision = choose_running_target(curve, demand, cap)
        self.last = (decision, curve, raw)
        return decision

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
            # What the decision used: at a common context, smoothed, thinly measured sizes
            # credited with the doubt.
            "step_time_s_by_batch": {str(b): round(t, 6) for b, t in sorted(curve.points.items())},
            # What the scheduler measured: [decode steps, mean s, std s, mean context tokens].
            "measured_by_batch": measured,
            "context_cost_s_per_token": None if context is None else context.cost_per_token_s,
            "context_per_sample": None if context is None else round(context.context_per_sample, 1),
        }
