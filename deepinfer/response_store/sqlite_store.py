"""Response records in one SQLite file (WAL mode), the embedded default.

Several processes on one machine may share the file: every write is one `BEGIN IMMEDIATE`
transaction, readers never block writers, and a busy database is waited for (busy_timeout).
`synchronous=NORMAL` keeps every committed record across a crash of the process; a power loss
may lose the last transactions.

The bytes a record holds (its JSON and its stream events) are counted in its `size`, and
triggers keep the total in `store_meta`, so enforcing the size cap never scans the table.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from deepinfer.response_store.records import ACTIVE_STATUSES, EventsPage, StoredResponse, with_status
from deepinfer.store.clock import SYSTEM_CLOCK, Clock
from deepinfer.store.retention import RetentionPolicy

SCHEMA_VERSION = 1
_EVICT_BATCH = 64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    status TEXT NOT NULL,
    background INTEGER NOT NULL,
    done INTEGER NOT NULL,
    traffic_class TEXT NOT NULL,
    ttl REAL NOT NULL,
    last_access REAL NOT NULL,
    expires_at REAL NOT NULL,
    response BLOB NOT NULL,
    input_items BLOB NOT NULL,
    ancestors BLOB NOT NULL,
    num_events INTEGER NOT NULL,
    size INTEGER NOT NULL,
    PRIMARY KEY (tenant, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS responses_by_expiry ON responses (expires_at);
CREATE INDEX IF NOT EXISTS responses_by_access ON responses (last_access);
CREATE TABLE IF NOT EXISTS response_events (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    frame TEXT NOT NULL,
    PRIMARY KEY (tenant, id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS store_meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO store_meta VALUES ('bytes', 0);
CREATE TRIGGER IF NOT EXISTS count_insert AFTER INSERT ON responses BEGIN
    UPDATE store_meta SET value = value + NEW.size WHERE name = 'bytes';
END;
CREATE TRIGGER IF NOT EXISTS count_update AFTER UPDATE OF size ON responses BEGIN
    UPDATE store_meta SET value = value + NEW.size - OLD.size WHERE name = 'bytes';
END;
CREATE TRIGGER IF NOT EXISTS count_delete AFTER DELETE ON responses BEGIN
    UPDATE store_meta SET value = value - OLD.size WHERE name = 'bytes';
    DELETE FROM response_events WHERE tenant = OLD.tenant AND id = OLD.id;
END;
"""

_COLUMNS = "id, tenant, status, background, done, traffic_class, response, input_items, ancestors"


class SqliteResponseStore:
    def __init__(
        self,
        path: str | Path,
        *,
        retention: RetentionPolicy,
        max_bytes: int,
        clock: Clock = SYSTEM_CLOCK,
        busy_timeout_s: float = 10.0,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.retention = retention
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        # One connection shared by the server's worker threads, serialized by the lock.
        self._db = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise RuntimeError(
                f"{self.path}: response store schema {version} is not {SCHEMA_VERSION}; "
                "move the file away (a newer DeepInfer wrote it)"
            )
        # executescript commits on its own; the script is its own transaction.
        self._db.executescript(f"BEGIN IMMEDIATE;\n{_SCHEMA}\nPRAGMA user_version={SCHEMA_VERSION};\nCOMMIT;")

    def _transaction(self, *, write: bool = True) -> _Transaction:
        return _Transaction(self._db, write=write)

    # -- writes --------------------------------------------------------------------------------

    def put(self, record: StoredResponse, frames: Sequence[str] = ()) -> None:
        ttl = self.retention.ttl(record.traffic_class)
        now = self.clock.now()
        response = msgspec.json.encode(record.response)
        items = msgspec.json.encode(record.input_items)
        ancestors = msgspec.json.encode(record.ancestors)
        size = len(response) + len(items) + len(ancestors) + sum(len(f) for f in frames)
        with self._lock, self._transaction():
            self._db.execute(
                "DELETE FROM responses WHERE tenant = ? AND id = ?", (record.tenant, record.response_id)
            )
            self._db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.tenant,
                    record.response_id,
                    record.status,
                    int(record.background),
                    int(record.done),
                    record.traffic_class,
                    ttl,
                    now,
                    now + ttl,
                    response,
                    items,
                    ancestors,
                    len(frames),
                    size,
                ),
            )
            self._insert_frames(record.tenant, record.response_id, 0, frames)
            self._evict(now)

    def _insert_frames(self, tenant: str, response_id: str, first: int, frames: Sequence[str]) -> None:
        self._db.executemany(
            "INSERT INTO response_events VALUES (?, ?, ?, ?)",
            [(tenant, response_id, first + i, frame) for i, frame in enumerate(frames)],
        )

    def _evict(self, now: float) -> None:
        self._db.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
        while self._total_bytes() > self.max_bytes:
            oldest = self._db.execute(
                "SELECT tenant, id FROM responses ORDER BY last_access LIMIT ?", (_EVICT_BATCH,)
            ).fetchall()
            if not oldest:
                break
            for tenant, response_id in oldest:
                self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
                if self._total_bytes() <= self.max_bytes:
                    break

    def _total_bytes(self) -> int:
        return int(self._db.execute("SELECT value FROM store_meta WHERE name = 'bytes'").fetchone()[0])

    def advance(
        self,
        tenant: str,
        response_id: str,
        frames: Sequence[str],
        response: dict[str, Any] | None = None,
        *,
        done: bool = False,
    ) -> str | None:
        now = self.clock.now()
        with self._lock, self._transaction():
            row = self._db.execute(
                "SELECT status, num_events, ttl, expires_at, response FROM responses "
                "WHERE tenant = ? AND id = ?",
                (tenant, response_id),
            ).fetchone()
            if row is None or row[3] <= now:
                return None
            status, num_events, ttl, _, old = row
            grown = sum(len(f) for f in frames)
            new = old
            if response is not None:
                if status == "cancelled":
                    response = with_status(response, "cancelled")
                new = msgspec.json.encode(response)
                status = response["status"]
            self._insert_frames(tenant, response_id, num_events, frames)
            self._db.execute(
                "UPDATE responses SET status = ?, response = ?, num_events = ?, done = MAX(done, ?), "
                "size = size + ?, last_access = ?, expires_at = ? WHERE tenant = ? AND id = ?",
                (
                    status,
                    new,
                    num_events + len(frames),
                    int(done),
                    grown + len(new) - len(old),
                    now,
                    now + ttl,
                    tenant,
                    response_id,
                ),
            )
            return str(status)

    def cancel(self, tenant: str, response_id: str, response: dict[str, Any]) -> StoredResponse | None:
        now = self.clock.now()
        cancelled = msgspec.json.encode(with_status(response, "cancelled"))
        with self._lock, self._transaction():
            row = self._db.execute(
                "SELECT status, response FROM responses WHERE tenant = ? AND id = ? AND expires_at > ?",
                (tenant, response_id, now),
            ).fetchone()
            if row is None:
                return None
            if row[0] in ACTIVE_STATUSES:
                self._db.execute(
                    "UPDATE responses SET status = 'cancelled', response = ?, size = size + ? "
                    "WHERE tenant = ? AND id = ?",
                    (cancelled, len(cancelled) - len(row[1]), tenant, response_id),
                )
            return self._read(tenant, [response_id], now)[0]

    def delete(self, tenant: str, response_id: str) -> bool:
        now = self.clock.now()
        with self._lock, self._transaction():
            deleted = self._db.execute(
                "DELETE FROM responses WHERE tenant = ? AND id = ? AND expires_at > ?",
                (tenant, response_id, now),
            ).rowcount
            return deleted > 0

    # -- reads ---------------------------------------------------------------------------------

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return self.get_many(tenant, [response_id])[0]

    def get_many(self, tenant: str, response_ids: Sequence[str]) -> list[StoredResponse | None]:
        if not response_ids:
            return []
        now = self.clock.now()
        with self._lock, self._transaction():
            return self._read(tenant, response_ids, now, touch=True)

    def _read(
        self, tenant: str, response_ids: Sequence[str], now: float, *, touch: bool = False
    ) -> list[StoredResponse | None]:
        found: dict[str, StoredResponse] = {}
        unique = list(dict.fromkeys(response_ids))
        for start in range(0, len(unique), 500):  # SQLite's bound on host parameters
            ids = unique[start : start + 500]
            marks = ",".join("?" * len(ids))
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM responses WHERE tenant = ? AND id IN ({marks}) AND expires_at > ?",
                (tenant, *ids, now),
            ).fetchall()
            for row in rows:
                found[row[0]] = _record(row)
            if touch and rows:
                self._db.execute(
                    f"UPDATE responses SET last_access = ?, expires_at = ? + ttl "
                    f"WHERE tenant = ? AND id IN ({marks}) AND expires_at > ?",
                    (now, now, tenant, *ids, now),
                )
        return [found.get(response_id) for response_id in response_ids]

    def events_after(self, tenant: str, response_id: str, after: int) -> EventsPage | None:
        now = self.clock.now()
        with self._lock, self._transaction(write=False):
            row = self._db.execute(
                "SELECT status, done FROM responses WHERE tenant = ? AND id = ? AND expires_at > ?",
                (tenant, response_id, now),
            ).fetchone()
            if row is None:
                return None
            frames = self._db.execute(
                "SELECT frame FROM response_events WHERE tenant = ? AND id = ? AND seq > ? ORDER BY seq",
                (tenant, response_id, after),
            ).fetchall()
        return EventsPage([f for (f,) in frames], status=row[0], done=bool(row[1]))

    def total_bytes(self) -> int:
        with self._lock:
            return self._total_bytes()

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _record(row: tuple[Any, ...]) -> StoredResponse:
    response_id, tenant, _, background, done, traffic_class, response, items, ancestors = row
    return StoredResponse(
        response_id=response_id,
        tenant=tenant,
        response=msgspec.json.decode(response),
        input_items=msgspec.json.decode(items),
        ancestors=msgspec.json.decode(ancestors),
        traffic_class=traffic_class,
        background=bool(background),
        done=bool(done),
    )


class _Transaction:
    """`BEGIN IMMEDIATE` ... `COMMIT` (ROLLBACK on error): writers take the lock up front, so
    two processes never both read and then fail to upgrade. Readers take a plain snapshot."""

    def __init__(self, db: sqlite3.Connection, *, write: bool) -> None:
        self._db = db
        self._begin = "BEGIN IMMEDIATE" if write else "BEGIN"

    def __enter__(self) -> None:
        self._db.execute(self._begin)

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        self._db.execute("COMMIT" if error is None else "ROLLBACK")
