"""The weight versions a server has served, in order: one small object shared by the segment
runner (what a continuation runs under), the background and the calls (staleness), so all
three read the same history and none needs the others to ask what version is current."""

from __future__ import annotations

from april_server.engine.base import BaseEngine


class WeightVersions:
    def __init__(self, engine: BaseEngine) -> None:
        self.engine = engine
        self.history: list[str] = []  # every version seen, oldest first (staleness by index)

    def now(self) -> str:
        """The version new tokens are generated with (recorded in the history on first sight)."""
        v = self.engine.weight_version()
        if not self.history or self.history[-1] != v:
            self.history.append(v)
        return v
