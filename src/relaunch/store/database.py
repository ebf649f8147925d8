"""The store's SQLite database: its schema, one connection per thread, transactions, and a clear
error for a file that is not a usable database."""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from relaunch.errors import StoreError, StoreFull

__all__ = ["Database"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, chips INTEGER NOT NULL, state TEXT NOT NULL,
    isolated_at REAL, reason TEXT NOT NULL DEFAULT '', position INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, plan TEXT NOT NULL,
    status TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL,
    ended_at REAL, attempt INTEGER NOT NULL DEFAULT 1, attempt_started_at REAL,
    master_port INTEGER NOT NULL DEFAULT 0, last_step INTEGER
);
CREATE TABLE IF NOT EXISTS pods (
    job_id INTEGER NOT NULL, idx INTEGER NOT NULL, node TEXT NOT NULL,
    generation INTEGER NOT NULL, schedule_cnt INTEGER NOT NULL, proc_start_cnt INTEGER NOT NULL,
    workdir TEXT NOT NULL, PRIMARY KEY (job_id, idx)
);
CREATE TABLE IF NOT EXISTS faults (
    id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL, fault TEXT NOT NULL,
    at REAL NOT NULL, detected_at REAL NOT NULL, source TEXT NOT NULL DEFAULT ''
);
CREATE UNIQUE INDEX IF NOT EXISTS faults_source ON faults (job_id, source) WHERE source != '';
CREATE TABLE IF NOT EXISTS recoveries (
    id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL, fault_id INTEGER NOT NULL,
    action TEXT NOT NULL, cause TEXT NOT NULL, reason TEXT NOT NULL, pods TEXT NOT NULL,
    isolated TEXT NOT NULL, consumed TEXT NOT NULL, tried TEXT NOT NULL,
    counters TEXT NOT NULL, budgets TEXT NOT NULL,
    started_at REAL NOT NULL, resumed_at REAL, mttr_s REAL, outcome TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS chaos_fired (
    job_id INTEGER NOT NULL, idx INTEGER NOT NULL, at REAL NOT NULL, PRIMARY KEY (job_id, idx)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY, job_id INTEGER, at REAL NOT NULL, text TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS progress (
    job_id INTEGER NOT NULL, at REAL NOT NULL, step INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS progress_job ON progress (job_id, at);
CREATE TABLE IF NOT EXISTS pending_decisions (
    job_id INTEGER NOT NULL, fault_id INTEGER NOT NULL, tried TEXT NOT NULL,
    PRIMARY KEY (job_id, fault_id)
);
"""

# Columns added after the first release: a state directory written by an older relaunch gains them.
MIGRATIONS = (
    ("jobs", "project", "TEXT NOT NULL DEFAULT 'default'"),
    ("jobs", "stop_requested", "TEXT"),
    ("nodes", "chip_faults", "TEXT NOT NULL DEFAULT '[]'"),
    ("nodes", "last_heartbeat", "REAL"),
    ("jobs", "membership", "TEXT"),
    ("chaos_fired", "note", "TEXT NOT NULL DEFAULT ''"),
    ("jobs", "controller_seen_at", "REAL"),
    ("faults", "collateral_of", "INTEGER"),
    ("faults", "evidence", "TEXT"),
    ("jobs", "left_behind", "INTEGER"),
    ("recoveries", "phase", "TEXT NOT NULL DEFAULT 'running'"),
    ("recoveries", "state", "TEXT NOT NULL DEFAULT '{}'"),
    ("events", "kind", "TEXT NOT NULL DEFAULT ''"),
    ("jobs", "stop_cause", "TEXT"),
    ("events", "fields", "TEXT NOT NULL DEFAULT '{}'"),
)


class Database:
    """One SQLite database, one connection per thread: a transaction or a row id read on one
    thread can never be another thread's (the server answers from a thread pool)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        if not path.exists():
            with _errors_named(path):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        _owner_only(path)
        with _errors_named(path):
            db = self._db
            db.execute("PRAGMA journal_mode=WAL")
            with self.transaction():  # two processes opening one new state dir: one migrates
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                for table, column, declaration in MIGRATIONS:
                    known = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
                    if column not in known:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")

    @property
    def _db(self) -> sqlite3.Connection:
        """This thread's connection (opened on first use)."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
            self._local.depth = 0
            with self._lock:
                self._connections.append(db)
        return db

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        with _errors_named(self.path):
            return self._db.execute(sql, params)

    def _execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with _errors_named(self.path):
            self._db.executemany(sql, rows)

    def _all(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with _errors_named(self.path):
            return self._db.execute(sql, params).fetchall()

    def _one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        with _errors_named(self.path):
            row: sqlite3.Row | None = self._db.execute(sql, params).fetchone()
            return row

    def changed_elsewhere(self) -> bool:
        """Whether another connection (another process: the API, `relaunch stop`; or another
        thread) committed a change since this thread last asked. True the first time."""
        row = self._one("PRAGMA data_version")
        version = int(row[0]) if row is not None else -1
        changed = version != getattr(self._local, "data_version", None)
        self._local.data_version = version
        return changed

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for db in connections:
            db.close()
        self._local = threading.local()

    @property
    def in_transaction(self) -> bool:
        """Whether this thread is inside `transaction` (nothing may wait on others there)."""
        return bool(getattr(self._local, "depth", 0))

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """All writes inside happen together or not at all (a controller killed midway). Nested
        uses on one thread join the outermost transaction."""
        db = self._db
        if self._local.depth:
            self._local.depth += 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with _errors_named(self.path):
            db.execute("BEGIN IMMEDIATE")
        self._local.depth = 1
        try:
            yield
        except BaseException:
            self._local.depth = 0
            db.execute("ROLLBACK")
            raise
        self._local.depth = 0
        with _errors_named(self.path):
            db.execute("COMMIT")


@contextmanager
def _errors_named(path: Path) -> Iterator[None]:
    """A damaged or foreign database file becomes a :class:`StoreError` naming it (one line for
    the user, not a traceback). A busy database stays an OperationalError: it is not damaged."""
    try:
        yield
    except sqlite3.OperationalError as error:
        if "locked" in str(error) or "busy" in str(error):
            raise  # busy, not broken: the caller may try again
        if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            raise StoreFull(str(path), str(error)) from None  # full, not broken either
        raise StoreError(str(path), str(error)) from None
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull(str(path), error.strerror or str(error)) from None
        if isinstance(error, PermissionError | IsADirectoryError):
            raise StoreError(str(path), str(error)) from None
        raise
    except sqlite3.DatabaseError as error:
        raise StoreError(str(path), str(error) or type(error).__name__) from None


def _owner_only(path: Path) -> None:
    """The database holds every job's spec and environment: readable by its owner only."""
    for candidate in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if candidate.stat().st_mode & 0o077 and candidate.stat().st_uid == os.getuid():
                candidate.chmod(0o600)
        except OSError:
            continue
