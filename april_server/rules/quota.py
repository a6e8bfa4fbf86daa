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
        self.rejected: set[str] = set()

    @property
    def accepted(self) -> list[str]:
        return [g for g in self.finished if g not in self.rejected]

    @property
    def met(self) -> bool:
        return len(self.accepted) >= self.target

    def finish(self, group_id: str) -> None:
        self.finished.append(group_id)

    def reject(self, group_ids: list[str]) -> None:
        unknown = [g for g in group_ids if g not in self.finished]
        if unknown:
            raise conflict("not_finished", f"only finished groups can be rejected: {unknown}")
        self.rejected.update(group_ids)
