"""`DELETE /april/v1/lengths`: forget every prompt's length history, here and in the store,
and what the pool advice remembers (it plays from those lengths: the next advice starts
afresh)."""

from __future__ import annotations

from dataclasses import dataclass

from april_server.buffer.store import BufferStore
from april_server.rules.lengths import LengthModel
from april_server.runtime.pool_sizing import PoolSizing


@dataclass(eq=False)
class ForgetLengths:
    lengths: LengthModel
    store: BufferStore
    sizing: PoolSizing  # its pool advice played from the lengths forgotten

    def __call__(self) -> int:
        """How many prompts it held."""
        n = self.lengths.forget()
        self.store.save_lengths([], forget=True)
        self.sizing.forget()
        return n
