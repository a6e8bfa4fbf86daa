"""How late the event loop runs a timer: every route on the server (ours and SGLang's
TokenizerManager, which share the loop) waits at least that long. Sampled every 20 ms over
a sliding window of the last minute; shown in `/stats` and `/metrics`, so "never block the
event loop" is a figure a user can watch, not a promise."""

from __future__ import annotations

import asyncio
import time
from collections import deque

PERIOD_S = 0.02
WINDOW = 3000  # samples: one minute at PERIOD_S


class LoopLagMonitor:
    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.max_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sampling on the running loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(PERIOD_S)
            lag = max(0.0, time.perf_counter() - t - PERIOD_S)
            self.recent.append(lag)
            self.max_s = max(self.max_s, lag)

    def figures(self) -> dict[str, float]:
        window = sorted(self.recent)
        p99 = window[min(len(window) - 1, int(0.99 * len(window)))] if window else 0.0
        return {
            "event_loop_lag_p99_s": round(p99, 6),  # over the last minute
            "event_loop_lag_recent_max_s": round(window[-1] if window else 0.0, 6),
            "event_loop_lag_max_s": round(self.max_s, 6),  # since start
        }
