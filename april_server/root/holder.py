"""A process's bookkeeping, built in two steps: the durable state at start-up (before the server
answers anything), and the root once an engine exists (SGLang's only once its server runs, an
owner's once its first engine answered). The command line (`cli.py`) and the owner
(`fleet/gateway.py`) build it the same way; it hands the process's weight session the root's
weight cut, so the weight routes cut exactly the segments this root runs.
"""

from __future__ import annotations

from collections.abc import Callable

from april_server.engine.base import BaseEngine
from april_server.engine.weight_session import WeightSession
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.settings.config import AprilConfig


class RootHolder:
    def __init__(
        self,
        config: AprilConfig,
        make_engine: Callable[[], BaseEngine],
        weights: WeightSession,
        sweep_default_s: float = 0.0,
    ) -> None:
        """Opens the durable state now. `sweep_default_s`: the mode's snapshot sweep interval,
        unless the config gives one."""
        self.config = config
        self.make_engine = make_engine
        self.weights = weights
        sweep = config.snapshot_sweep_s
        self.sweep_s = sweep_default_s if sweep is None else sweep
        self.durable = Durable.open(config.buffer_path)
        self._root: RolloutManager | None = None

    def peek(self) -> RolloutManager | None:
        """The root if it was built (nothing of ours runs before it is)."""
        return self._root

    def get(self) -> RolloutManager:
        if self._root is None:
            root = RolloutManager(
                self.make_engine(),
                self.durable,
                self.config,
                sweep_s=self.sweep_s,
                watch_loop=True,  # first use is a request: on the server's loop
            )
            self.weights.cut_by(root.weight_cut)
            self._root = root
        return self._root
