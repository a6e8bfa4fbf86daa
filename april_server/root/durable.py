"""What the server keeps across a restart, opened at start-up: the store (SQLite, fsynced), the
partial buffer's idle index over it, and every prompt's length history.

The one recovery path: a server starting on a state dir (and the simulator's crash and restart,
tests/sim) rebuild the core from what is here. Opening is O(groups + prompts stored), so it runs
at start-up, before the server answers anything, never on the first request (on SGLang's event
loop, which every request shares).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from april_server.buffer.partial_buffer import PartialBuffer
from april_server.buffer.store import BufferStore
from april_server.rules.lengths import LengthHistory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Durable:
    store: BufferStore
    buffer: PartialBuffer  # idle groups as summaries (bodies stay in the store until claimed)
    lengths: LengthHistory

    @classmethod
    def open(cls, path: Path | None) -> Durable:
        """The store at `path` (None: in memory only, lost on exit) and what it holds."""
        if path is None:
            logger.warning("no --april-state-dir: the partial buffer is in memory only")
        t0 = time.perf_counter()
        durable = cls.load(BufferStore(path))
        logger.info(
            "april: partial buffer %s: %d idle groups, %d samples, %d prompts' lengths, "
            "loaded in %.2f s",
            path,
            len(durable.buffer.idle),
            durable.buffer.idle.samples,
            len(durable.lengths),
            time.perf_counter() - t0,
        )
        return durable

    @classmethod
    def load(cls, store: BufferStore) -> Durable:
        """What an open store holds: the idle index and the length history."""
        lengths = LengthHistory()
        lengths.load(store.load_lengths())
        return cls(store, PartialBuffer(store), lengths)
