"""The store: nodes, jobs, pods, faults and recovery records, in SQLite (WAL).

Everything a controller needs to carry on after a restart lives here: the desired state of every
pod (node, generation, counters), the job's attempt, budgets spent (derived from the records),
which planned faults already fired, and the faults still waiting for a decision. The controller
writes a job's running state; the API and the CLI add jobs, stop requests, fault-plan entries and
node cordons.

Every thread gets its own SQLite connection (a server answers requests from a thread pool): a
transaction or a row id read on one thread can never be another thread's. The database file is
created readable by its owner only (it holds every job's spec and environment).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from relaunch.errors import StoreError
from relaunch.faults import Cause, Fault, FaultKind, Severity
from relaunch.policy import Action, Budget, Counters, Decision, JobHistory, RecoveryRecord

__all__ = [
    "JOB_ID",
    "JobRow",
    "JobStatus",
    "NodeRow",
    "NodeState",
    "PodRow",
    "RecordRow",
    "Store",
]

JOB_ID = re.compile(r"[0-9]{1,18}")
"""A job id as text: ASCII digits only ('²' is a digit to str.isdigit, not to int)."""

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
)


class NodeState(StrEnum):
    READY = "Ready"
    FAULTY = "Faulty"
    ISOLATED = "Isolated"
    LOST = "Lost"


class JobStatus(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"

    @property
    def active(self) -> bool:
        """A controller owns the job (or owned it and died: the job waits to be resumed)."""
        return self in (JobStatus.RUNNING, JobStatus.RECOVERING)

    @property
    def ended(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)


class Outcome(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class NodeRow:
    name: str
    chips: int
    state: NodeState
    isolated_at: float | None
    reason: str
    position: int
    chip_faults: tuple[dict[str, Any], ...] = ()
    """The chips the node's agent reports faulty: chip, code, kind, since."""
    last_heartbeat: float | None = None

    @property
    def schedulable(self) -> bool:
        return self.state is NodeState.READY


@dataclass(frozen=True)
class JobRow:
    id: int
    name: str
    spec: dict[str, Any]
    plan: list[dict[str, Any]]
    status: JobStatus
    reason: str
    created_at: float
    ended_at: float | None
    attempt: int
    attempt_started_at: float | None
    master_port: int
    last_step: int | None
    project: str = "default"
    stop_requested: str | None = None
    """Why a stop was asked for (API or CLI) while the job ran; its controller carries it out."""
    membership: dict[str, Any] | None = None
    """The process group's current membership, for process-level recovery (see train.group)."""
    controller_seen_at: float | None = None
    """When the job's controller last said it was alive (a resume tells how long it was away)."""


@dataclass(frozen=True)
class PodRow:
    job_id: int
    idx: int
    node: str
    generation: int
    schedule_cnt: int
    proc_start_cnt: int
    workdir: str

    @property
    def counters(self) -> Counters:
        return Counters(self.schedule_cnt, self.proc_start_cnt)


@dataclass(frozen=True)
class RecordRow:
    id: int
    job_id: int
    fault_id: int
    fault: Fault
    fault_at: float
    detected_at: float
    action: Action
    cause: Cause
    reason: str
    pods: tuple[int, ...]
    isolated: tuple[str, ...]
    consumed: tuple[Budget, ...]
    tried: tuple[Action, ...]
    counters: tuple[Counters, ...]
    budgets: dict[str, int]
    started_at: float
    resumed_at: float | None
    mttr_s: float | None
    outcome: Outcome

    def to_json(self) -> dict[str, Any]:
        f = self.fault
        return {
            "fault": {
                "kind": f.kind.value,
                "code": f.code,
                "node": f.node,
                "chip": f.chip,
                "pod": f.pod,
                "rank": f.rank,
                "exit_code": f.exit_code,
                "signal": f.signal,
                "duration_s": f.duration_s,
            },
            "action": self.action.value,
            "reason": self.reason,
            "isolated_nodes": list(self.isolated),
            "consumed_budget": [b.value for b in self.consumed],
            "budgets_left": self.budgets,
            "counters_after": [
                {"pod": i, "schedule_count": c.schedule_cnt, "proc_start_count": c.proc_start_cnt}
                for i, c in enumerate(self.counters)
            ],
            "fault_at": self.fault_at,
            "detected_at": self.detected_at,
            "detect_s": round(self.detected_at - self.fault_at, 3),
            "started_at": self.started_at,
            "resumed_at": self.resumed_at,
            "mttr_s": self.mttr_s,
            "outcome": self.outcome.value,
        }


def fault_to_json(fault: Fault) -> str:
    data = asdict(fault)
    data["kind"] = fault.kind.value
    data["reported_severity"] = fault.reported_severity.name if fault.reported_severity else None
    return json.dumps(data)


def fault_from_json(text: str) -> Fault:
    data = json.loads(text)
    data["kind"] = FaultKind(data["kind"])
    severity = data.get("reported_severity")
    data["reported_severity"] = Severity[severity] if severity else None
    return Fault(**data)


class Store:
    """One SQLite database in the state directory, one connection per thread."""

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

    def _all(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with _errors_named(self.path):
            return self._db.execute(sql, params).fetchall()

    def _one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        with _errors_named(self.path):
            row: sqlite3.Row | None = self._db.execute(sql, params).fetchone()
            return row

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for db in connections:
            db.close()
        self._local = threading.local()

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

    # -- nodes ----------------------------------------------------------------------------------

    def ensure_nodes(self, nodes: Sequence[tuple[str, int]]) -> None:
        """Adds nodes the store does not know, in order; known nodes keep their state."""
        for position, (name, chips) in enumerate(nodes):
            self._execute(
                "INSERT INTO nodes (name, chips, state, position) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET chips = excluded.chips, position = excluded.position",
                (name, chips, NodeState.READY.value, position),
            )

    def nodes(self) -> list[NodeRow]:
        rows = self._all("SELECT * FROM nodes ORDER BY position")
        return [
            NodeRow(
                r["name"],
                r["chips"],
                NodeState(r["state"]),
                r["isolated_at"],
                r["reason"],
                r["position"],
                tuple(json.loads(r["chip_faults"])),
                r["last_heartbeat"],
            )
            for r in rows
        ]

    def node(self, name: str) -> NodeRow | None:
        return next((n for n in self.nodes() if n.name == name), None)

    def set_node_state(
        self, name: str, state: NodeState, reason: str = "", at: float | None = None
    ) -> None:
        isolated_at = at if state is NodeState.ISOLATED else None
        self._execute(
            "UPDATE nodes SET state = ?, reason = ?, isolated_at = COALESCE(?, isolated_at) "
            "WHERE name = ?",
            (state.value, reason, isolated_at, name),
        )

    def set_chip_health(self, name: str, faults: Sequence[Mapping[str, Any]], at: float) -> None:
        """What a node's last heartbeat said of its chips (only changes are written)."""
        text = json.dumps(list(faults), sort_keys=True)
        self._execute(
            "UPDATE nodes SET chip_faults = ?, last_heartbeat = ? WHERE name = ? "
            "AND (chip_faults != ? OR last_heartbeat IS NULL OR ? - last_heartbeat > 1.0)",
            (text, at, name, text, at),
        )

    # -- jobs -----------------------------------------------------------------------------------

    def create_job(
        self,
        name: str,
        spec: Mapping[str, Any],
        plan: Sequence[Mapping[str, Any]],
        now: float,
        project: str = "default",
    ) -> int:
        row = self._one(
            "INSERT INTO jobs (name, spec, plan, status, created_at, attempt_started_at, project) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (
                name,
                json.dumps(spec),
                json.dumps(list(plan)),
                JobStatus.PENDING.value,
                now,
                now,
                project,
            ),
        )
        assert row is not None
        return int(row["id"])

    def claim_job(self, job_id: int, now: float) -> bool:
        """Pending -> Running for exactly one runner; False if it was stopped or taken meanwhile."""
        cursor = self._execute(
            "UPDATE jobs SET status = ?, attempt_started_at = ? WHERE id = ? AND status = ?",
            (JobStatus.RUNNING.value, now, job_id, JobStatus.PENDING.value),
        )
        return cursor.rowcount == 1

    def request_stop(self, job_id: int, reason: str, now: float) -> JobStatus:
        """A pending job stops at once; a running one is marked and its controller stops it."""
        with self.transaction():
            job = self.job(job_id)
            if job.status is JobStatus.PENDING:
                self.update_job(job_id, status=JobStatus.STOPPED, reason=reason, ended_at=now)
                return JobStatus.STOPPED
            if not job.status.ended:
                self.update_job(job_id, stop_requested=reason)
            return job.status

    def append_plan(self, job_id: int, entries: Sequence[Mapping[str, Any]]) -> int:
        """Adds fault-plan entries to a job; returns the index of the first one added."""
        with self.transaction():
            plan = self.job(job_id).plan
            self.update_job(job_id, plan=json.dumps([*plan, *entries]))
        return len(plan)

    def add_progress(self, job_id: int, at: float, step: int) -> None:
        self._execute(
            "INSERT INTO progress (job_id, at, step) VALUES (?, ?, ?)", (job_id, at, step)
        )

    def progress(self, job_id: int, since: float | None = None) -> list[tuple[float, int]]:
        rows = self._all(
            "SELECT at, step FROM progress WHERE job_id = ? AND at > ? ORDER BY at",
            (job_id, since if since is not None else 0.0),
        )
        return [(r["at"], r["step"]) for r in rows]

    def job(self, job_id: int) -> JobRow:
        row = self._one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if row is None:
            raise KeyError(job_id)
        return self._job(row)

    def jobs(self) -> list[JobRow]:
        return [self._job(r) for r in self._all("SELECT * FROM jobs ORDER BY id")]

    def find_job(self, ref: str) -> JobRow | None:
        """A job by id (ASCII digits), or the newest job with that name."""
        if JOB_ID.fullmatch(ref):
            row = self._one("SELECT * FROM jobs WHERE id = ?", (int(ref),))
        else:
            row = self._one("SELECT * FROM jobs WHERE name = ? ORDER BY id DESC LIMIT 1", (ref,))
        return self._job(row) if row else None

    @staticmethod
    def _job(r: sqlite3.Row) -> JobRow:
        return JobRow(
            r["id"],
            r["name"],
            json.loads(r["spec"]),
            json.loads(r["plan"]),
            JobStatus(r["status"]),
            r["reason"],
            r["created_at"],
            r["ended_at"],
            r["attempt"],
            r["attempt_started_at"],
            r["master_port"],
            r["last_step"],
            r["project"],
            r["stop_requested"],
            json.loads(r["membership"]) if r["membership"] else None,
            r["controller_seen_at"],
        )

    def update_job(self, job_id: int, **fields: Any) -> None:
        if not fields:
            return
        values = [
            v.value if isinstance(v, StrEnum) else json.dumps(v) if isinstance(v, dict) else v
            for v in fields.values()
        ]
        assignments = ", ".join(f"{k} = ?" for k in fields)
        self._execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values, job_id))

    # -- pods -----------------------------------------------------------------------------------

    def pods(self, job_id: int) -> list[PodRow]:
        rows = self._all("SELECT * FROM pods WHERE job_id = ? ORDER BY idx", (job_id,))
        return [
            PodRow(
                r["job_id"],
                r["idx"],
                r["node"],
                r["generation"],
                r["schedule_cnt"],
                r["proc_start_cnt"],
                r["workdir"],
            )
            for r in rows
        ]

    def put_pod(self, pod: PodRow) -> None:
        self._execute(
            "INSERT OR REPLACE INTO pods VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                pod.job_id,
                pod.idx,
                pod.node,
                pod.generation,
                pod.schedule_cnt,
                pod.proc_start_cnt,
                pod.workdir,
            ),
        )

    # -- faults and records -----------------------------------------------------------------------

    def add_fault(
        self, job_id: int, fault: Fault, detected_at: float, source: str = ""
    ) -> int | None:
        """Stores an observed fault; None if a fault from the same source was stored before."""
        row = self._one(
            "INSERT OR IGNORE INTO faults (job_id, fault, at, detected_at, source) "
            "VALUES (?, ?, ?, ?, ?) RETURNING id",
            (job_id, fault_to_json(fault), fault.at, detected_at, source),
        )
        return None if row is None else int(row["id"])

    def faults(self, job_id: int, before: int | None = None) -> list[Fault]:
        rows = self._all(
            "SELECT fault FROM faults WHERE job_id = ? AND id < ? ORDER BY id",
            (job_id, before if before is not None else 2**62),
        )
        return [fault_from_json(r["fault"]) for r in rows]

    def add_record(
        self,
        job_id: int,
        fault_id: int,
        decision: Decision,
        tried: Sequence[Action],
        budgets: Mapping[str, int],
        started_at: float,
        outcome: Outcome,
    ) -> int:
        """A recovery record: the decision taken for a fault, what had been tried before it,
        the budgets left after it, and (until it is settled) how it went."""
        row = self._one(
            "INSERT INTO recoveries (job_id, fault_id, action, cause, reason, pods, isolated, consumed, "
            "tried, counters, budgets, started_at, outcome) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (
                job_id,
                fault_id,
                decision.action.value,
                decision.assessment.cause.value,
                decision.reason,
                json.dumps(list(decision.pods)),
                json.dumps(list(decision.isolate_nodes)),
                json.dumps(sorted(b.value for b in decision.consumes)),
                json.dumps(sorted(a.value for a in tried)),
                json.dumps([[c.schedule_cnt, c.proc_start_cnt] for c in decision.counters]),
                json.dumps(dict(budgets)),
                started_at,
                outcome.value,
            ),
        )
        assert row is not None
        return int(row["id"])

    def settle_record(
        self,
        record_id: int,
        outcome: Outcome,
        resumed_at: float | None = None,
        fault_at: float | None = None,
    ) -> None:
        mttr = None if resumed_at is None or fault_at is None else round(resumed_at - fault_at, 3)
        self._execute(
            "UPDATE recoveries SET outcome = ?, resumed_at = ?, mttr_s = ? WHERE id = ?",
            (outcome.value, resumed_at, mttr, record_id),
        )

    def records(self, job_id: int) -> list[RecordRow]:
        rows = self._all(
            "SELECT r.*, f.fault AS fault_json, f.at AS fault_at, f.detected_at AS detected_at "
            "FROM recoveries r JOIN faults f ON f.id = r.fault_id WHERE r.job_id = ? ORDER BY r.id",
            (job_id,),
        )
        return [
            RecordRow(
                id=r["id"],
                job_id=r["job_id"],
                fault_id=r["fault_id"],
                fault=fault_from_json(r["fault_json"]),
                fault_at=r["fault_at"],
                detected_at=r["detected_at"],
                action=Action(r["action"]),
                cause=Cause(r["cause"]),
                reason=r["reason"],
                pods=tuple(json.loads(r["pods"])),
                isolated=tuple(json.loads(r["isolated"])),
                consumed=tuple(Budget(b) for b in json.loads(r["consumed"])),
                tried=tuple(Action(a) for a in json.loads(r["tried"])),
                counters=tuple(Counters(s, p) for s, p in json.loads(r["counters"])),
                budgets=json.loads(r["budgets"]),
                started_at=r["started_at"],
                resumed_at=r["resumed_at"],
                mttr_s=r["mttr_s"],
                outcome=Outcome(r["outcome"]),
            )
            for r in rows
        ]

    def history(self, job_id: int, before_fault: int | None = None) -> JobHistory:
        """The policy's view of the job's past, rebuilt from the records; `before_fault` leaves
        out the fault being decided and any after it."""
        pods = self.pods(job_id)
        records = tuple(
            RecoveryRecord(
                at=r.started_at,
                fault=r.fault,
                cause=r.cause,
                action=r.action,
                pods=r.pods,
                consumes=frozenset(r.consumed),
                isolated=r.isolated,
                succeeded=None if r.outcome is Outcome.RUNNING else r.outcome is Outcome.SUCCEEDED,
            )
            for r in self.records(job_id)
        )
        return JobHistory(
            pods=len(pods),
            faults=tuple(self.faults(job_id, before_fault)),
            records=records,
            counters=tuple(p.counters for p in pods),
        )

    # -- fault plan, events ---------------------------------------------------------------------

    def fired(self, job_id: int) -> dict[int, tuple[float, str]]:
        """Fault-plan entries done with, by index: when, and "" if fired or why not."""
        rows = self._all("SELECT idx, at, note FROM chaos_fired WHERE job_id = ?", (job_id,))
        return {r["idx"]: (r["at"], r["note"]) for r in rows}

    def mark_fired(self, job_id: int, idx: int, at: float, note: str = "") -> None:
        """An entry is done with: fired (`note` empty) or, saying why, not fired."""
        self._execute(
            "INSERT INTO chaos_fired (job_id, idx, at, note) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (job_id, idx) DO UPDATE SET note = excluded.note",
            (job_id, idx, at, note),
        )

    # -- faults waiting for a decision ------------------------------------------------------------

    def add_pending(self, job_id: int, fault_id: int, tried: Sequence[Action]) -> None:
        """`fault_id` needs a (next) decision, `tried` already done for it. Written in the same
        transaction as the fault (or as the record that failed), so that a controller killed
        before it decides finds the fault still waiting after a restart."""
        self._execute(
            "INSERT INTO pending_decisions (job_id, fault_id, tried) VALUES (?, ?, ?) "
            "ON CONFLICT (job_id, fault_id) DO UPDATE SET tried = excluded.tried",
            (job_id, fault_id, json.dumps(sorted(a.value for a in tried))),
        )

    def drop_pending(self, job_id: int, fault_id: int) -> None:
        self._execute(
            "DELETE FROM pending_decisions WHERE job_id = ? AND fault_id = ?", (job_id, fault_id)
        )

    def pending(self, job_id: int) -> list[tuple[int, Fault, frozenset[Action]]]:
        """Faults waiting for a decision, oldest first: (fault id, fault, actions tried)."""
        rows = self._all(
            "SELECT p.fault_id, p.tried, f.fault FROM pending_decisions p "
            "JOIN faults f ON f.id = p.fault_id WHERE p.job_id = ? ORDER BY p.fault_id",
            (job_id,),
        )
        return [
            (
                int(r["fault_id"]),
                fault_from_json(r["fault"]),
                frozenset(Action(a) for a in json.loads(r["tried"])),
            )
            for r in rows
        ]

    def event(self, job_id: int | None, text: str, at: float | None = None) -> None:
        self._execute(
            "INSERT INTO events (job_id, at, text) VALUES (?, ?, ?)",
            (job_id, at or time.time(), text),
        )

    def events(self, job_id: int) -> list[tuple[float, str]]:
        rows = self._all("SELECT at, text FROM events WHERE job_id = ? ORDER BY id", (job_id,))
        return [(r["at"], r["text"]) for r in rows]


@contextmanager
def _errors_named(path: Path) -> Iterator[None]:
    """A damaged or foreign database file becomes a :class:`StoreError` naming it (one line for
    the user, not a traceback). A busy database stays an OperationalError: it is not damaged."""
    try:
        yield
    except sqlite3.OperationalError as error:
        if "locked" in str(error) or "busy" in str(error):
            raise  # busy, not broken: the caller may try again
        raise StoreError(str(path), str(error)) from None
    except (sqlite3.DatabaseError, PermissionError, IsADirectoryError) as error:
        raise StoreError(str(path), str(error) or type(error).__name__) from None


def _owner_only(path: Path) -> None:
    """The database holds every job's spec and environment: readable by its owner only."""
    for candidate in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if candidate.stat().st_mode & 0o077 and candidate.stat().st_uid == os.getuid():
                candidate.chmod(0o600)
        except OSError:
            continue
