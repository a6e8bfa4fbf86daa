"""The running target of `max_inflight_groups: "auto"` calls, decided per call from the
engine's measured step curve (`rules/inflight.py`); the newest decision is kept for the pool
advice (`stats.groups_wanted`, `rules/pool_size.py`) and for `/stats`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from april_server.engine.base import BaseEngine
from april_server.rules.inflight import (
    InflightDecision,
    StepCurve,
    StepStat,
    choose_running_target,
)


class InflightPolicy:
    def __init__(self, engine: BaseEngine) -> None:
        self.engine = engine
        self.last: tuple[InflightDecision, StepCurve, Mapping[int, float | StepStat]] | None = None

    async def decide(self, demand: int, cap: int) -> InflightDecision:
        raw = await self.engine.step_curve()
        curve = StepCurve.smoothed(raw)
        decision = choose_running_target(curve, demand, cap)
        self.last = (decision, curve, raw)
        return decision

    def last_curve(self) -> StepCurve | None:
        """The newest decision's curve (a call's own, or a later one's)."""
        return None if self.last is None else self.last[1]

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
