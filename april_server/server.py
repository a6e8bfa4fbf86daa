"""Wires config, engine, store and manager together for one server process."""

from __future__ import annotations

import logging
from collections.abc import Callable

from april_server.config import AprilConfig
from april_server.engine_base import BaseEngine
from april_server.manager import RolloutManager
from april_server.store import BufferStore

logger = logging.getLogger(__name__)


class ManagerHolder:
    """Builds the manager on first use: SGLang's engine exists only once its server runs."""

    def __init__(self, config: AprilConfig, make_engine: Callable[[], BaseEngine]) -> None:
        self.config = config
        self.make_engine = make_engine
        self._manager: RolloutManager | None = None

    def get(self) -> RolloutManager:
        if self._manager is None:
            path = self.config.buffer_path
            if path is None:
                logger.warning("no --april-state-dir: the partial buffer is in memory only")
            store = BufferStore(path)
            self._manager = RolloutManager(
                self.make_engine(), store, allow_stale_kv=self.config.allow_stale_kv
            )
            logger.info("april: partial buffer %s with %d groups", path, len(self._manager.groups))
        return self._manager
