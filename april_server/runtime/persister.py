"""Making an outcome durable: the groups it buffers and deletes, a call's answer for its
retries, and the lengths learned meanwhile, in one fsynced commit off the event loop."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from april_client.protocol import Group
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.buffer.store import BufferStore
from april_server.engine.segment_state import Running
from april_server.rules.lengths import LengthHistory


@dataclass(eq=False)
class Persister:
    buffer: PartialBuffer
    store: BufferStore
    running: Mapping[str, Running]  # sample id -> its engine request (the segment runner's)
    lengths: LengthHistory

    async def persist(
        self, put: list[Group], delete: list[str], call: tuple[str, bytes] | None = None
    ) -> None:
        """Called before acknowledging: what is answered is on disk."""
        running = self.running
        live = [g.group_id for g in put if any(s.sample_id in running for s in g.samples)]
        await self.buffer.persist(put, delete, call, live)
        dirty = self.lengths.take_dirty()
        if dirty:
            self.store.save_lengths(dirty)
