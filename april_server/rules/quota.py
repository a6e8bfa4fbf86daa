"""Finish order and acceptance of groups within one call: the quota (`target_groups`) counts
whole groups as they finish; a streamed call's trainer may reject finished ones (DAPO-style
filtering), which un-counts them."""

from __future__ import annotations

from april_server.wire.errors import conflict


class QuotaTracker:
    """Finish order and acceptance of groups within one call (DAPO rejects un-count)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.finished: list[str] = []  # finish order, rejected ones included
        self._counted: set[str] = set()
        self.rejected: set[str] = set()

    @property
    def accepted(self) -> list[str]:
        return [g for g in self.finished if g not in self.rejected]

    @property
    def met(self) -> bool:
        return len(self.accepted) >= self.target

    def finish(self, group_id: str) -> bool:
        """Count a finished group once; False if it was counted already. Two paths can see
        the same group finish: an answered agent member run before its group was started
        (it ends the episode), then the group taken off the ready queue with nothing left
        to run. Counting it twice would meet the quota a group early and return it twice."""
        if group_id in self._counted:
            return False
        self._counted.add(group_id)
        self.finished.append(group_id)
        return True

    def reject(self, group_ids: list[str]) -> None:
        unknown = [g for g in group_ids if g not in self._counted]
        if unknown:
            raise conflict("not_finished", f"only finished groups can be rejected: {unknown}")
        self.rejected.update(group_ids)
