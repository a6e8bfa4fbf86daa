"""The simulated engine: the fake engine's tokens (a hash of the context, so any interruption
resumes to the same tokens), with seeded step times, slow steps and injected failures, and a
watch that fails the run if one sample ever has two requests at once."""

from __future__ import annotations

import random
from typing import Any

from tests.unit.fake_engine import SnapshotFakeEngine


class SimEngine(SnapshotFakeEngine):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng
        self.fail_p = 0.0  # chance that a request fails outright (an engine error)
        self.slow_p = 0.02  # chance that a decode step takes 20-100x longer
        self.live: dict[str, str] = {}  # sample id -> its request now
        self.double: list[str] = []

    @property  # type: ignore[override]
    def delay_s(self) -> float:  # one decode step
        if self.rng.random() < self.slow_p:
            return self.rng.uniform(0.02, 0.1)
        return self.rng.uniform(0.0005, 0.002)

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        pass

    async def generate(self, rid: str, ids: list[int], params: dict[str, Any]) -> Any:
        sid = rid.partition("@")[0]
        if sid in self.live:
            self.double.append(f"{sid}: {self.live[sid]} and {rid}")
        self.live[sid] = rid
        try:
            if self.fail_p and self.rng.random() < self.fail_p:
                raise RuntimeError("simulated engine error")
            return await super().generate(rid, ids, params)
        finally:
            if self.live.get(sid) == rid:
                del self.live[sid]
