"""The idle part of the partial buffer, in memory: one small summary per group, by age.

Bodies (tokens, logprobs, segments) live in the store (`store.py`) and are read only when a
call claims a group or a route lists it; this index answers everything else without touching
them: claim the oldest (O(log n) per group), counts for `/stats` (O(1)), pages of
`/partials` (O(page), each group at its stable position `seq`). Pure Python.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import msgspec
from sortedcontainers import SortedDict

from april_client.protocol import Group

StatusFilter = Literal["partial", "finished"]
MAX_SCAN_PER_PAGE = 20_000  # a filtered page stops scanning here and says where to go on


class BufferEntry(msgspec.Struct, gc=False):
    """One idle group's summary. Not tracked by Python's garbage collector (`gc=False`: it
    holds only strings and numbers, so it can be in no reference cycle): a full collection
    would otherwise walk a million of them on the event loop, ~60 ms per 250k groups."""

    group_id: str
    seq: int  # position in age order: given when the group is first buffered, kept after
    created_at: float
    num_samples: int
    unfinished: int  # members still partial (0: a finished surplus group)
    output_tokens: int
    versions: tuple[str, ...]  # distinct weight versions its segments were generated under
    # Of its unfinished members: context tokens now (prompt + appended + output) and budget
    # left, so admission can bound the KV a group will need without reading its body.
    context_tokens: int = 0
    remaining_tokens: int = 0
    # Of its unfinished members, those awaiting input (agent rollouts): not runnable until
    # an answer arrives, so not in `context_tokens`/`remaining_tokens`.
    awaiting: int = 0

    @property
    def runnable(self) -> int:
        return self.unfinished - self.awaiting


def open_footprint(group: Group) -> tuple[int, int, int]:
    """(runnable members, their context tokens now, their budget left): what starting the
    group asks of the engine. Members awaiting input do not run."""
    open_ = [s for s in group.samples if s.status == "partial"]
    context = sum(
        len(s.prompt_ids) + len(s.output_ids) + sum(len(a.ids) for a in s.appended) for s in open_
    )
    left = sum(max(0, s.max_new_tokens - len(s.output_ids)) for s in open_)
    return len(open_), context, left


def summarize(group: Group, seq: int) -> BufferEntry:
    versions = {seg.weight_version for s in group.samples for seg in s.segments}
    runnable, context, left = open_footprint(group)
    awaiting = sum(1 for s in group.samples if s.status == "awaiting_input")
    return BufferEntry(
        group_id=group.group_id,
        seq=seq,
        created_at=group.created_at,
        num_samples=len(group.samples),
        unfinished=runnable + awaiting,
        output_tokens=sum(len(s.output_ids) for s in group.samples),
        versions=tuple(sorted(versions)),
        context_tokens=context,
        remaining_tokens=left,
        awaiting=awaiting,
    )


@dataclass(frozen=True, slots=True)
class PartialsFilter:
    """`GET /partials` filters: status, minimum age, weight version (all optional)."""

    status: StatusFilter | None = None  # partial: some member unfinished; finished: none
    min_age_s: float | None = None
    weight_version: str | None = None  # some segment was generated under this version

    def matches(self, e: BufferEntry, now: float) -> bool:
        if self.status == "partial" and e.unfinished == 0:
            return False
        if self.status == "finished" and e.unfinished > 0:
            return False
        if self.min_age_s is not None and now - e.created_at < self.min_age_s:
            return False
        return self.weight_version is None or self.weight_version in e.versions


def _waits(e: BufferEntry) -> bool:
    """Unfinished, with every unfinished member awaiting an answer: nothing a call can run."""
    return e.unfinished > 0 and e.runnable == 0


class BufferIndex:
    """Groups by age in two sorted maps: those waiting only for answers (agent episodes whose
    tools have not answered, perhaps never will) apart, so that a call claiming the oldest
    runnable groups never walks past them (`claimable_oldest`); listing and paging see both,
    merged by age."""

    def __init__(self, entries: Iterable[BufferEntry] = ()) -> None:
        self._by_seq: SortedDict = SortedDict()  # all but the waiting ones
        self._waiting: SortedDict = SortedDict()
        self._by_id: dict[str, BufferEntry] = {}
        self.samples = 0
        self.output_tokens = 0
        self.unfinished_samples = 0
        self.unfinished_groups = 0
        self.awaiting_samples = 0
        self.waiting_groups = 0  # unfinished, but every unfinished member awaits input
        for e in entries:
            self.add(e)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._by_id

    def get(self, group_id: str) -> BufferEntry | None:
        return self._by_id.get(group_id)

    def _map(self, e: BufferEntry) -> SortedDict:
        return self._waiting if _waits(e) else self._by_seq

    def add(self, e: BufferEntry) -> None:
        self.remove(e.group_id)
        taken = self._by_seq.get(e.seq) or self._waiting.get(e.seq)
        if taken is not None:
            raise ValueError(f"seq {e.seq} is taken by {taken.group_id!r}")
        self._map(e)[e.seq] = e
        self._by_id[e.group_id] = e
        self._count(e, 1)

    def remove(self, group_id: str) -> BufferEntry | None:
        e = self._by_id.pop(group_id, None)
        if e is not None:
            del self._map(e)[e.seq]
            self._count(e, -1)
        return e

    def _count(self, e: BufferEntry, sign: int) -> None:
        self.samples += sign * e.num_samples
        self.output_tokens += sign * e.output_tokens
        self.unfinished_samples += sign * e.unfinished
        self.unfinished_groups += sign * (e.unfinished > 0)
        self.awaiting_samples += sign * e.awaiting
        self.waiting_groups += sign * (e.unfinished > 0 and e.runnable == 0)

    @property
    def claimable(self) -> int:
        """Idle groups a call can use now: all but those waiting for answers only."""
        return len(self._by_id) - self.waiting_groups

    def oldest(self) -> Iterator[BufferEntry]:
        """Oldest first. Do not add or remove while iterating."""
        return (self._entry(seq) for seq in self._seqs(None))

    def claimable_oldest(self) -> Iterator[BufferEntry]:
        """Oldest first, leaving out the groups that wait only for answers: O(what is read),
        however many of those there are."""
        return iter(self._by_seq.values())

    def _seqs(self, start_seq: int | None) -> Iterator[int]:
        own = self._by_seq.irange(minimum=start_seq)
        if not self._waiting:
            return iter(own)
        return heapq.merge(own, self._waiting.irange(minimum=start_seq))

    def _entry(self, seq: int) -> BufferEntry:
        e: BufferEntry | None = self._by_seq.get(seq)
        if e is None:
            e = self._waiting[seq]
        return e

    def page(
        self,
        start_seq: int,
        limit: int,
        where: PartialsFilter,
        now: float,
        max_scan: int = MAX_SCAN_PER_PAGE,
    ) -> tuple[list[BufferEntry], int | None]:
        """Up to `limit` matching groups at `seq >= start_seq`, oldest first, and the `seq` to
        start the next page at (None: nothing after). Scans at most `max_scan` groups, so a
        page under a selective filter may hold fewer than `limit` and still have a next."""
        out: list[BufferEntry] = []
        scanned = 0
        for seq in self._seqs(start_seq):
            if len(out) >= limit or scanned >= max_scan:
                return out, seq
            scanned += 1
            e = self._entry(seq)
            if where.matches(e, now):
                out.append(e)
        return out, None
