"""Durable partial buffer: SQLite (stdlib) in the state dir, fsynced before acknowledging.

What is durable: every buffered group (tokens, logprobs, segments, params) and the response
of every completed call that carried a `request_id` (so a retry returns the same result).
What is volatile: KV snapshots and in-flight generation (a crash loses only what no response
has acknowledged yet; the buffered state before that call is intact).

Nothing here runs on the event loop: one thread owns the connection and runs every operation
in the order it was submitted (`db_thread.py`), and callers await a future. WAL +
`synchronous=FULL` makes each commit fsync the log before the future resolves (acknowledge
after fsync); commits queued behind one another share one transaction and one fsync, each in
its own savepoint. Every statement is O(log n) in the buffer's size: groups
are keyed by id and ordered by an indexed `seq`; a restart reads only the summary columns
(`buffer_index.py`), through a covering index, and bodies are read when a group is used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import sqlite3
import uuid
import weakref
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from april_client.protocol import Group
from april_server.buffer.buffer_index import BufferEntry, summarize
from april_server.buffer.db_thread import DbThread
from april_server.rules.lengths import MAX_PROMPTS
from april_server.rules.samples import clear_snapshot

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS buffer (
    group_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    created_at REAL NOT NULL,
    num_samples INTEGER NOT NULL,
    unfinished INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    versions BLOB NOT NULL,
    context_tokens INTEGER NOT NULL,
    remaining_tokens INTEGER NOT NULL,
    boot TEXT NOT NULL,
    body BLOB NOT NULL,
    awaiting INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS calls (
    request_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_by_seq ON calls (seq);
CREATE TABLE IF NOT EXISTS lengths (
    prompt_key TEXT PRIMARY KEY,
    seen INTEGER NOT NULL,
    lengths BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS lengths_by_seen ON lengths (seen);
"""
# The summaries, read at start-up from this covering index without touching the bodies.
_SUMMARY_INDEX = """
CREATE INDEX IF NOT EXISTS buffer_summary_by_seq_v3
    ON buffer (seq, group_id, created_at, num_samples, unfinished, output_tokens, versions,
               context_tokens, remaining_tokens, awaiting);
DROP INDEX IF EXISTS buffer_summary_by_seq;
"""
_SUMMARY = (
    "seq, group_id, created_at, num_samples, unfinished, output_tokens, versions,"
    " context_tokens, remaining_tokens, awaiting"
)
MAX_REMEMBERED_CALLS = 10_000  # idempotency window; the oldest responses are forgotten first
# ... and at most this many bytes of them: a row is a whole response (every returned sample's
# tokens and logprobs), so a trainer that names every call would otherwise keep 10,000 steps.
MAX_REMEMBERED_CALL_BYTES = 256 << 20
CALLS_PRUNE_EVERY = 64  # remembered calls between two checks of their bytes
LENGTHS_PRUNE_EVERY = 64  # saves of the length history between two prunes of its table
WAL_LIMIT_BYTES = 64 << 20
_READ_CHUNK = 500  # ids per SELECT ... IN (...)

_json_group = msgspec.json.Decoder(Group)
_pack = msgspec.msgpack.Encoder()
_unpack_group = msgspec.msgpack.Decoder(Group)
_versions_dec = msgspec.msgpack.Decoder(list[str])
_lengths_dec = msgspec.msgpack.Decoder(list[int])

T = TypeVar("T")


def encode_group(g: Group) -> bytes:
    return _pack.encode(g)


def decode_group(body: bytes) -> Group:
    # Version-1 state dirs stored JSON bodies; a JSON object never starts a msgpack map.
    return _json_group.decode(body) if body[:1] == b"{" else _unpack_group.decode(body)


def _open(path: Path | None) -> sqlite3.Connection:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(":memory:" if path is None else str(path), isolation_level=None)
    if path is not None:
        db.execute("PRAGMA journal_mode=WAL")
        # The WAL keeps the size of its largest commit (a big call's) unless told otherwise.
        db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(_SCHEMA)
    _migrate_v2(db)
    db.executescript(_SUMMARY_INDEX)
    _migrate_v1(db)
    return db


def _migrate_v2(db: sqlite3.Connection) -> None:
    """Version 2 had no `awaiting` column (agent rollouts): add it; its rows await nothing."""
    columns = [row[1] for row in db.execute("PRAGMA table_info(buffer)")]
    if "awaiting" not in columns:
        db.execute("ALTER TABLE buffer ADD COLUMN awaiting INTEGER NOT NULL DEFAULT 0")


def _migrate_v1(db: sqlite3.Connection) -> None:
    """Version 1 kept `groups(group_id, seq, body JSON)` and no summary columns: move its rows
    over once, in age order, ids as they are (ids the contract now refuses stay reachable)."""
    old = db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='groups'")
    if old.fetchone() is None:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        rows = db.execute("SELECT body FROM groups ORDER BY seq").fetchall()
        for seq, (body,) in enumerate(rows, start=1):
            g = decode_group(bytes(body))
            _upsert(db, [(g, summarize(g, seq))], boot="v1")
        db.execute("DROP TABLE groups")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    logger.info("april: moved %d buffered groups to the version-2 buffer table", len(rows))


def _upsert(
    db: sqlite3.Connection, put: Iterable[tuple[Group | bytes, BufferEntry]], boot: str
) -> None:
    """Each group's row: its summary `e`, its body (a group, or one encoded already)."""
    db.executemany(
        "INSERT INTO buffer (group_id, seq, created_at, num_samples, unfinished, output_tokens,"
        " versions, context_tokens, remaining_tokens, boot, body, awaiting)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(group_id) DO UPDATE SET seq = excluded.seq,"
        " created_at = excluded.created_at, num_samples = excluded.num_samples,"
        " unfinished = excluded.unfinished, output_tokens = excluded.output_tokens,"
        " versions = excluded.versions, context_tokens = excluded.context_tokens,"
        " remaining_tokens = excluded.remaining_tokens, boot = excluded.boot,"
        " body = excluded.body, awaiting = excluded.awaiting",
        (
            (
                e.group_id,
                e.seq,
                e.created_at,
                e.num_samples,
                e.unfinished,
                e.output_tokens,
                _pack.encode(list(e.versions)),
                e.context_tokens,
                e.remaining_tokens,
                boot,
                g if isinstance(g, bytes) else encode_group(g),
                e.awaiting,
            )
            for g, e in put
        ),
    )


def _forget_calls_beyond(db: sqlite3.Connection, max_bytes: int) -> None:
    """Forget the oldest remembered responses until the rest hold at most `max_bytes` (the
    newest always stays). `length()` of a blob reads its row header, not its pages."""
    row = db.execute(
        "SELECT seq FROM (SELECT seq, SUM(length(body)) OVER (ORDER BY seq DESC) AS newer"
        " FROM calls) WHERE newer > ? ORDER BY seq DESC LIMIT 1",
        (max_bytes,),
    ).fetchone()
    if row is not None:
        db.execute(
            "DELETE FROM calls WHERE seq <= ? AND seq < (SELECT MAX(seq) FROM calls)", (row[0],)
        )


class BufferStore:
    """One SQLite file. `path=None` keeps everything in memory (tests, no --april-state-dir).

    Async methods are for the event loop (they only await the store's thread); the blocking
    ones are for start-up, tests and integrity checks."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        # Bodies written by this process carry its boot id: a body from an earlier boot has
        # snapshot figures of KV that died with that process.
        self.boot = uuid.uuid4().hex
        self._db = DbThread(lambda: _open(path))
        self._finalizer = weakref.finalize(self, self._db.stop)
        self._next_call_seq = self._blocking(
            lambda db: int(db.execute("SELECT COALESCE(MAX(seq), 0) FROM calls").fetchone()[0]) + 1
        )
        self.max_prompts = MAX_PROMPTS  # length history rows kept (`save_lengths`)
        self.max_call_bytes = MAX_REMEMBERED_CALL_BYTES
        self._seen = self._blocking(
            lambda db: int(db.execute("SELECT COALESCE(MAX(seen), 0) FROM lengths").fetchone()[0])
        )

    # ---- plumbing ----------------------------------------------------------------------------

    def _blocking(self, fn: Callable[[sqlite3.Connection], T], write: bool = False) -> T:
        return self._db.submit(fn, write).result()

    async def _async(self, fn: Callable[[sqlite3.Connection], T], write: bool = False) -> T:
        return await asyncio.wrap_future(self._db.submit(fn, write))

    def close(self) -> None:
        self._finalizer()

    # ---- start-up ----------------------------------------------------------------------------

    def load_index(self) -> list[BufferEntry]:
        """Summaries of every stored group, oldest first (bodies stay on disk)."""

        def read(db: sqlite3.Connection) -> list[BufferEntry]:
            rows = db.execute(f"SELECT {_SUMMARY} FROM buffer ORDER BY seq").fetchall()
            return [
                BufferEntry(
                    gid, seq, created, n, unfinished, out, tuple(_versions(v)), ctx, left, aw
                )
                for seq, gid, created, n, unfinished, out, v, ctx, left, aw in rows
            ]

        return self._blocking(read)

    # ---- the event loop's side ---------------------------------------------------------------

    async def commit(
        self,
        put: list[tuple[Group, int]],
        delete: list[str],
        call: tuple[str, bytes] | None = None,
        live: Collection[str] = (),
    ) -> list[BufferEntry]:
        """Atomically upsert `put` (each group at its `seq`), delete `delete` and remember
        `call`; durable on return, with the summaries written. The groups are summarized and
        encoded on the store's thread: the caller must not change them until this returns
        (they are claimed by the caller's call). Except `live` ones, which go on generating
        meanwhile (a `continue` call's stragglers): those are summarized and encoded here, at
        one moment, or their row could pair a summary with a later body, or catch a sample
        half-way through recording a segment (cost: what is handed on, not the buffer)."""
        call_seq = 0
        if call is not None:
            call_seq = self._next_call_seq
            self._next_call_seq += 1
        boot = self.boot
        frozen = {
            g.group_id: (encode_group(g), summarize(g, seq)) for g, seq in put if g.group_id in live
        }

        def write(db: sqlite3.Connection) -> list[BufferEntry]:
            rows: list[tuple[Group | bytes, BufferEntry]] = [
                frozen.get(g.group_id) or (g, summarize(g, seq)) for g, seq in put
            ]
            if delete:
                db.executemany("DELETE FROM buffer WHERE group_id = ?", [(g,) for g in delete])
            if rows:
                _upsert(db, rows, boot)
            if call is not None:
                db.execute(
                    "INSERT OR REPLACE INTO calls (request_id, seq, body) VALUES (?, ?, ?)",
                    (call[0], call_seq, call[1]),
                )
                db.execute("DELETE FROM calls WHERE seq <= ?", (call_seq - MAX_REMEMBERED_CALLS,))
                if call_seq % CALLS_PRUNE_EVERY == 0:
                    _forget_calls_beyond(db, self.max_call_bytes)
            return [e for _, e in rows]

        return await self._async(write, write=True)

    async def read_groups(self, group_ids: list[str]) -> dict[str, Group]:
        """The stored bodies of `group_ids` (absent ids are left out)."""
        boot = self.boot

        def read(db: sqlite3.Connection) -> dict[str, Group]:
            out: dict[str, Group] = {}
            for i in range(0, len(group_ids), _READ_CHUNK):
                chunk = group_ids[i : i + _READ_CHUNK]
                marks = ",".join("?" * len(chunk))
                q = f"SELECT group_id, boot, body FROM buffer WHERE group_id IN ({marks})"
                for gid, row_boot, body in db.execute(q, chunk):
                    out[gid] = _fresh_from(decode_group(bytes(body)), row_boot == boot)
            return out

        return await self._async(read)

    async def load_call(self, request_id: str) -> bytes | None:
        def read(db: sqlite3.Connection) -> bytes | None:
            row = db.execute(
                "SELECT body FROM calls WHERE request_id = ?", (request_id,)
            ).fetchone()
            return None if row is None else bytes(row[0])

        return await self._async(read)

    # ---- blocking, O(buffer): start-up tools, tests and integrity checks only -----------------

    def bulk_put(self, rows: Iterable[tuple[Group, BufferEntry]]) -> None:
        """Write many groups in one transaction (synthetic buffers for benchmarks and tests;
        the server itself only commits through `commit`)."""
        boot = self.boot

        def write(db: sqlite3.Connection) -> None:
            _upsert(db, rows, boot)

        self._blocking(write, write=True)

    def load_lengths(self) -> list[tuple[str, list[int]]]:
        """Every prompt's stored finished lengths (`rules/lengths.py`), least recently seen
        first (start-up)."""

        def read(db: sqlite3.Connection) -> list[tuple[str, list[int]]]:
            rows = db.execute("SELECT prompt_key, lengths FROM lengths ORDER BY seen").fetchall()
            return [(k, _lengths_dec.decode(bytes(v))) for k, v in rows]

        return self._blocking(read)

    def save_lengths(self, rows: list[tuple[str, list[int]]], forget: bool = False) -> None:
        """Upsert prompts' lengths (after `forget`: every other row deleted first), on the
        store's thread, not awaited: the history is advice, so a crash may lose its last
        entries but nothing waits for it."""
        self._seen += 1
        seen = self._seen

        def write(db: sqlite3.Connection) -> None:
            if forget:
                db.execute("DELETE FROM lengths")
            db.executemany(
                "INSERT OR REPLACE INTO lengths (prompt_key, seen, lengths) VALUES (?, ?, ?)",
                [(k, seen, _pack.encode(v)) for k, v in rows],
            )
            if seen % LENGTHS_PRUNE_EVERY == 0:
                # As in memory (`LengthHistory.max_prompts`): the least recently seen prompts
                # go, or the file would keep one row for every prompt ever seen.
                db.execute(
                    "DELETE FROM lengths WHERE seen < (SELECT seen FROM lengths"
                    " ORDER BY seen DESC LIMIT 1 OFFSET ?)",
                    (self.max_prompts - 1,),
                )

        done = self._db.submit(write, write=True)
        done.add_done_callback(_log_failure)

    def load_all(self) -> list[Group]:
        """Every stored group, oldest first."""
        boot = self.boot

        def read(db: sqlite3.Connection) -> list[Group]:
            rows = db.execute("SELECT boot, body FROM buffer ORDER BY seq").fetchall()
            return [_fresh_from(decode_group(bytes(b)), boot_ == boot) for boot_, b in rows]

        return self._blocking(read)


def _log_failure(done: cf.Future[Any]) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.warning("saving the length history failed: %s", done.exception())


def _versions(blob: bytes) -> list[str]:
    return _versions_dec.decode(blob)


def _fresh_from(g: Group, this_boot: bool) -> Group:
    if not this_boot:  # KV snapshots are volatile: none survive a restart
        for s in g.samples:
            clear_snapshot(s)
    return g
