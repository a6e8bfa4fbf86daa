"""The partial buffer: which groups exist, which call holds each, and what is durable.

- Idle groups are summaries in `BufferIndex` (by age); their bodies are in the store.
- Who holds a group is one record (`holders`: group id -> `Holder`), changed only by
  synchronous transitions: the decision and its record happen with no `await` between them.
- A call claims groups (by name, or the oldest that fit what it can run): they leave the index
  and get their holder at once, synchronously, so no other call can take them; their bodies are
  then read from the store into memory (`claimed`), where the call changes them. While the read
  is in flight the holder says so (`Holder.arrived` is clear): `resolve` waits it out, so a
  route never sees a group that is neither idle nor in memory.
- `persist` makes a call's outcome durable (the store's thread, fsync) before it is answered;
  `release` hands the claimed groups back: the durable ones return to the index at their old
  position and leave memory, the rest (never acknowledged) are forgotten.
So memory holds the claimed groups and one summary per idle group, and every operation costs
what it touches, not the buffer's size.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from april_client.protocol import Group, Sample
from april_server.buffer.buffer_index import BufferEntry, BufferIndex, summarize
from april_server.buffer.store import BufferStore
from april_server.wire.errors import conflict, not_found
from april_server.wire.ids import split_sample_id

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Holder:
    """Who holds a group that is not idle: a call (`b-...`), the background, a resume, a
    delete, an answer (`input-...`) or new groups being made durable (`groups-...`)."""

    owner: str
    in_place: bool = False  # still listed in the index while held (the background's)
    # Clear while the group's body is being read from the store: set once it is in memory.
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)  # set when it lets go


class PartialBuffer:
    def __init__(self, store: BufferStore) -> None:
        self.store = store
        entries = store.load_index()
        self.idle = BufferIndex(entries)
        self.next_seq = max((e.seq for e in entries), default=0) + 1
        self.claimed: dict[str, Group] = {}  # group_id -> body, while someone holds it
        self.holders: dict[str, Holder] = {}  # group_id -> who holds it (absent: idle)
        self._owned: dict[str, set[str]] = {}  # owner -> its group ids (an index of `holders`)
        self._stored: dict[str, BufferEntry] = {}  # durable summary of claimed stored groups

    # ---- lookups -----------------------------------------------------------------------------

    def known(self, group_id: str) -> bool:
        # Held groups count even while their body is still being read: such a group must not
        # look free to a call sending the same id as new.
        return group_id in self.holders or group_id in self.idle

    def holder(self, group_id: str) -> Holder | None:
        return self.holders.get(group_id)

    def owner_of(self, group_id: str) -> str | None:
        h = self.holders.get(group_id)
        return None if h is None else h.owner

    def held_by(self, owner: str) -> set[str]:
        return set(self._owned.get(owner, ()))

    async def resolve(self, group_id: str) -> Holder | None:
        """Who holds the group now (None: idle in the buffer), once any transition in flight
        (a store read) has landed; 404 when the server holds no such group. Every route that
        addresses a group or a sample goes through here: it never sees a half-made hand-over."""
        while True:
            h = self.holders.get(group_id)
            if h is None:
                if group_id not in self.idle:
                    raise not_found(f"unknown group_id {group_id!r}")
                return None
            if h.arrived.is_set():
                return h
            await h.arrived.wait()

    async def read(self, group_ids: list[str]) -> dict[str, Group]:
        """Bodies to show (claimed ones as they are now, idle ones from the store); raises 404
        for an id that is neither. Changing an idle body read here changes nothing stored."""
        for gid in group_ids:
            if not self.known(gid):
                raise not_found(f"unknown group_id {gid!r}")
        return await self.read_bodies(group_ids)

    async def read_bodies(self, group_ids: list[str]) -> dict[str, Group]:
        """Like `read`, but ids that are gone (deleted, returned meanwhile) are left out."""
        out = {gid: self.claimed[gid] for gid in group_ids if gid in self.claimed}
        cold = [gid for gid in group_ids if gid not in out]
        if cold:
            out.update(await self.store.read_groups(cold))
        return out

    async def read_group(self, group_id: str) -> Group:
        return (await self.read([group_id]))[group_id]

    async def read_samples(self, sample_ids: list[str]) -> dict[str, Sample]:
        """Samples to show, claimed or idle; 404 for an unknown one."""
        parsed = {sid: split_sample_id(sid) for sid in sample_ids}
        gids = sorted({p[0] for p in parsed.values() if p is not None})
        groups = await self.read([g for g in gids if self.known(g)])
        return {sid: _member(groups, sid, parts) for sid, parts in parsed.items()}

    def claimed_sample(self, sample_id: str) -> Sample:
        """A member of a claimed group (idle ones: `read_samples`); 404 if none."""
        return _member(self.claimed, sample_id, split_sample_id(sample_id))

    # ---- claiming: `take*` decide and record at once, `arrive` reads the bodies ---------------

    def adopt(self, groups: list[Group], owner: str) -> None:
        """New groups of a call: claimed by it from the start, stored once persisted. All or
        none: 409 `group_exists` if the server knows one already (never an overwrite)."""
        for g in groups:
            if self.known(g.group_id):
                raise conflict("group_exists", f"group {g.group_id!r} is already known")
        for g in groups:
            self._hold(g.group_id, owner).arrived.set()
            self.claimed[g.group_id] = g

    async def claim(self, group_ids: list[str], owner: str, busy_code: str) -> list[Group]:
        """Claim named idle groups (all or none: 404 unknown, 409 `busy_code` held)."""
        return await self.arrive(self.take(group_ids, owner, busy_code))

    def take(self, group_ids: list[str], owner: str, busy_code: str) -> list[BufferEntry]:
        """Hold named idle groups for `owner` now (all or none: 404 unknown, 409 `busy_code`
        held); their bodies arrive with `arrive`."""
        for gid in group_ids:
            if gid in self.holders:
                raise conflict(busy_code, f"group {gid!r} is in use by {self.holders[gid].owner!r}")
            if gid not in self.idle:
                raise not_found(f"unknown group_id {gid!r}")
        entries = [e for gid in group_ids if (e := self.idle.remove(gid)) is not None]
        self._hold_entries(entries, owner)
        return entries

    def take_oldest(self, fits: Callable[[BufferEntry], bool], owner: str) -> list[BufferEntry]:
        """Hold the oldest idle groups for `owner` now while `fits(entry)` (it accounts for what
        it accepts), stopping at the first that does not: groups start in age order."""
        picked = []
        for e in self.idle.claimable_oldest():  # not those waiting only for answers
            if e.group_id in self.holders:  # held in place (background.py): not idle now
                continue
            if not fits(e):
                break
            picked.append(e)
        for e in picked:
            self.idle.remove(e.group_id)
        self._hold_entries(picked, owner)
        return picked

    def take_in_place(self, group_ids: list[str], owner: str) -> list[BufferEntry]:
        """Hold idle groups for work that leaves them listed and counted as buffered (the
        background, `background.py`): they stay in the index, so pages and counts do not
        change under a reader, but nobody else can claim them until `release_in_place`."""
        entries = [e for gid in group_ids if (e := self.idle.get(gid)) is not None]
        entries = [e for e in entries if e.group_id not in self.holders]
        self._hold_entries(entries, owner, in_place=True)
        return entries

    async def hold_in_place(self, group_ids: list[str], owner: str) -> list[Group]:
        return await self.arrive(self.take_in_place(group_ids, owner))

    def _hold_entries(self, entries: list[BufferEntry], owner: str, in_place: bool = False) -> None:
        for e in entries:
            self._hold(e.group_id, owner, in_place)
            self._stored[e.group_id] = e

    async def arrive(self, entries: list[BufferEntry]) -> list[Group]:
        """Read the bodies of groups just taken into memory, and mark them arrived. A read that
        fails (or is cancelled) hands them back untouched, as if never taken."""
        try:
            bodies = await self.store.read_groups([e.group_id for e in entries])
        except BaseException:
            for e in entries:
                self._untake(e)
            raise
        out = []
        for e in entries:
            g = bodies.get(e.group_id)
            if g is None:  # summary without body: cannot happen short of a bug; say so
                logger.error("april: buffered group %r has no stored body", e.group_id)
                self._untake(e)
                continue
            self.claimed[e.group_id] = g
            self.holders[e.group_id].arrived.set()
            out.append(g)
        return out

    def _untake(self, e: BufferEntry) -> None:
        h = self.holders.get(e.group_id)
        if h is None:
            return
        self._let_go(e.group_id).arrived.set()
        self._stored.pop(e.group_id, None)
        if not h.in_place and e.group_id not in self.idle:
            self.idle.add(e)

    def release_in_place(self, owner: str, group_ids: list[str] | None = None) -> None:
        """Hand back groups held in place (all of `owner`'s, or `group_ids`), with their
        summaries as last persisted."""
        for gid in list(self._owned.get(owner, ())) if group_ids is None else group_ids:
            if self.owner_of(gid) != owner:
                continue
            self._let_go(gid)
            self.claimed.pop(gid, None)
            entry = self._stored.pop(gid, None)
            self.idle.remove(gid)
            if entry is not None:
                self.idle.add(entry)

    def pass_held(self, gid: str, owner: str) -> None:
        """A group held in place (the background's, generating) becomes `owner`'s like a
        claimed one: out of the index, its body staying in memory, where its running samples
        record their segments."""
        self._let_go(gid)
        self.idle.remove(gid)
        self._hold(gid, owner).arrived.set()

    def pass_in_place(self, gid: str, owner: str) -> None:
        """The reverse of `pass_held`: a claimed group, persisted, becomes held in place by
        `owner` (the background): listed again at its position with its persisted summary,
        its body staying in memory, where its running samples record their segments."""
        entry = self._stored[gid]
        self._let_go(gid)
        self.idle.add(entry)
        self._hold(gid, owner, in_place=True).arrived.set()

    def _hold(self, gid: str, owner: str, in_place: bool = False) -> Holder:
        h = self.holders[gid] = Holder(owner, in_place)
        self._owned.setdefault(owner, set()).add(gid)
        return h

    def _let_go(self, gid: str) -> Holder:
        h = self.holders.pop(gid)
        mine = self._owned[h.owner]
        mine.discard(gid)
        if not mine:
            del self._owned[h.owner]
        h.released.set()
        return h

    def release(self, owner: str) -> None:
        """Hand back what `owner` holds: durable groups go back to the index at their position
        (their bodies leave memory); groups never made durable are forgotten."""
        for gid in list(self._owned.get(owner, ())):
            self._let_go(gid).arrived.set()
            self.claimed.pop(gid, None)
            entry = self._stored.pop(gid, None)
            if entry is not None:
                self.idle.add(entry)

    # ---- durability --------------------------------------------------------------------------

    async def persist(
        self,
        put: list[Group],
        delete: list[str],
        call: tuple[str, bytes] | None = None,
        live: Collection[str] = (),
    ) -> None:
        """Store claimed groups `put` (keeping each one's age position), delete `delete`,
        remember `call`: durable (fsynced) when this returns. `live`: those of `put` still
        generating meanwhile (`BufferStore.commit`)."""
        rows = []
        for g in put:
            old = self._stored.get(g.group_id)
            rows.append((g, old.seq if old is not None else self._new_seq()))
        entries = await self.store.commit(rows, delete, call, live)
        for e in entries:
            self._stored[e.group_id] = e
        for gid in delete:
            self._stored.pop(gid, None)

    def _new_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    # ---- integrity (tests): O(buffer) ----------------------------------------------------------

    def check(self, in_place: str | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent; valid at any moment between
        two callbacks. `in_place`: the owner whose groups stay in the index while held (the
        background). The store holds every idle group that nobody holds, as summarized (a
        held group's row may be mid-commit), and no row of a group that is neither idle nor
        held."""
        arrived = {gid for gid, h in self.holders.items() if h.arrived.is_set()}
        assert set(self.claimed) == arrived, (sorted(self.claimed), sorted(arrived))
        listed = {e.group_id: e for e in self.idle.oldest()}
        for gid, h in self.holders.items():
            assert h.in_place == (gid in listed), (gid, h.owner, h.in_place)
            assert not h.in_place or h.owner == in_place, (gid, h.owner)
        assert set(self._stored) <= set(self.holders)
        assert sum(len(v) for v in self._owned.values()) == len(self.holders)
        for owner, gids in self._owned.items():
            assert all(self.holders[g].owner == owner for g in gids), owner
        stored = {g.group_id: g for g in self.store.load_all()}
        for gid, e in listed.items():
            if gid in self.holders:
                continue
            assert gid in stored, f"idle group {gid} has no stored row"
            assert summarize(stored[gid], e.seq) == e, f"idle group {gid}: store and index differ"
        stray = set(stored) - set(listed) - set(self.holders)
        assert not stray, f"stored rows of groups nobody holds and not idle: {sorted(stray)}"


def _member(groups: Mapping[str, Group], sample_id: str, parts: tuple[str, int] | None) -> Sample:
    """The member `sample_id` (parsed as `parts`) names in `groups`; 404 if none."""
    g = groups.get(parts[0]) if parts else None
    if parts is None or g is None or parts[1] >= len(g.samples):
        raise not_found(f"unknown sample_id {sample_id!r}")
    return g.samples[parts[1]]
