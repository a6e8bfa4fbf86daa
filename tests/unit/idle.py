"""What the tests read of the buffer that the server never does: every idle group's body."""

from __future__ import annotations

from april_client.protocol import Group
from april_server.buffer.partial_buffer import PartialBuffer


def idle_bodies(buffer: PartialBuffer) -> list[Group]:
    """Every idle group's body, oldest first, from the store: O(buffer)."""
    return [g for g in buffer.store.load_all() if g.group_id in buffer.idle]
