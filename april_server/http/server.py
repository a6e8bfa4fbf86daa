"""Wires config, engine, store and manager together for one server process."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from april_server.buffer.partial_buffer import PartialBuffer
from april_server.buffer.store import BufferStore
from april_server.engine.base import BaseEngine
from april_server.root.manager import RolloutManager
from april_server.rules.lengths import LengthHistory
from april_server.runtime.loop_lag import LoopLagMonitor
from april_server.settings.config import AprilConfig

logger = logging.getLogger(__name__)


class ManagerHolder:
    """Loads the buffer at once (start-up, before the server answers anything) and builds the
    manager on first use: SGLang's engine exists only once its server runs."""

    def __init__(
        self,
        config: AprilConfig,
        make_engine: Callable[[], BaseEngine],
        sweep_default_s: float = 0.0,
    ) -> None:
        """`sweep_default_s`: the mode's snapshot sweep interval, unless the config gives one."""
        self.config = config
        sweep = config.snapshot_sweep_s
        self.sweep_s = sweep_default_s if sweep is None else sweep
        self.make_engine = make_engine
        self._manager: RolloutManager | None = None
        path = config.buffer_path
        if path is None:
            logger.warning("no --april-state-dir: the partial buffer is in memory only")
        t0 = time.perf_counter()
        self.store = BufferStore(path)
        self.buffer = PartialBuffer(self.store)
        # The length history too: O(prompts stored), so at start-up, not on the first request
        # (on SGLang's event loop, which every request shares).
        self.lengths = LengthHistory()
        self.lengths.load(self.store.load_lengths())
        logger.info(
            "april: partial buffer %s: %d idle groups, %d samples, %d prompts' lengths, "
            "loaded in %.2f s",
            path,
            len(self.buffer.idle),
            self.buffer.idle.samples,
            len(self.lengths),
            time.perf_counter() - t0,
        )

    def peek(self) -> RolloutManager | None:
        """The manager if it was built (nothing of ours runs before it is)."""
        return self._manager

    def get(self) -> RolloutManager:
        if self._manager is None:
            engine = self.make_engine()
            loop_lag = LoopLagMonitor()
            loop_lag.start()  # first use is a request: on the server's loop
            self._manager = RolloutManager(
                engine,
                self.store,
                allow_stale_kv=self.config.allow_stale_kv,
                buffer=self.buffer,
                lengths=self.lengths,
                length_order=self.config.length_order,
                placement=self.config.placement,
                loop_lag=loop_lag,
                sweep_s=self.sweep_s,
            )
        return self._manager
