"""Durable partial buffer: SQLite (stdlib) in the state dir, fsynced before acknowledging.

What is durable: every buffered group (tokens, logprobs, segments, params) and the response
of every completed call that carried a `request_id` (so a retry returns the same result).
What is volatile: KV snapshots and in-flight generation (a crash loses only what no response
has acknowledged yet; the buffered state before that call is intact).

WAL + `synchronous=FULL` makes each commit fsync the log before returning, and one commit
covers a whole call's outcome, so a crash leaves either the state before or after it.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import msgspec

from april_server.protocol import Group

_SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS calls (
    request_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL
);
"""
MAX_REMEMBERED_CALLS = 10_000  # idempotency window; the oldest responses are forgotten first

_enc = msgspec.json.Encoder()
_group_dec = msgspec.json.Decoder(Group)


class BufferStore:
    """One SQLite file. `path=None` keeps everything in memory (tests, no --april-state-dir)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            ":memory:" if path is None else str(path), check_same_thread=False, isolation_level=None
        )
        self._lock = threading.Lock()
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def load_groups(self) -> list[Group]:
        """Buffered groups, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT body FROM groups ORDER BY seq").fetchall()
        return [_group_dec.decode(r[0]) for r in rows]

    def load_call(self, request_id: str) -> bytes | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body FROM calls WHERE request_id = ?", (request_id,)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def commit(
        self,
        put: list[Group],
        delete: list[str],
        call: tuple[str, bytes] | None = None,
    ) -> None:
        """Atomically upsert `put`, delete `delete` and remember `call`; durable on return."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                if delete:
                    db.executemany("DELETE FROM groups WHERE group_id = ?", [(g,) for g in delete])
                for g in put:
                    # Keep a group's original position: "oldest first" means oldest created.
                    db.execute(
                        "INSERT INTO groups (group_id, seq, body) VALUES (?, "
                        "(SELECT COALESCE(MAX(seq), 0) + 1 FROM groups), ?) "
                        "ON CONFLICT(group_id) DO UPDATE SET body = excluded.body",
                        (g.group_id, _enc.encode(g)),
                    )
                if call is not None:
                    db.execute(
                        "INSERT OR REPLACE INTO calls (request_id, seq, body) VALUES (?, "
                        "(SELECT COALESCE(MAX(seq), 0) + 1 FROM calls), ?)",
                        call,
                    )
                    db.execute(
                        "DELETE FROM calls WHERE seq <= (SELECT MAX(seq) FROM calls) - ?",
                        (MAX_REMEMBERED_CALLS,),
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._db.close()
