"""Nodes, jobs and pods: the cluster's state and each job's desired state."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from relaunch.states import IllegalJobMove, StopCause, check_job_move
from relaunch.store.database import Database
from relaunch.store.rows import JobRow, JobStatus, NodeRow, NodeState, PodRow

__all__ = ["JOB_ID", "JobTable", "NodeTable", "PodTable"]

JOB_ID = re.compile(r"[0-9]{1,18}")
"""A job id as text: ASCII digits only ('²' is a digit to str.isdigit, not to int)."""


_CAUSES = frozenset(cause.value for cause in StopCause)
_STATUS_FIELDS = frozenset({"status", "ended_at", "reason", "stop_cause"})


def _column(value: Any) -> Any:
    """A job field's value as its column holds it."""
    if isinstance(value, StrEnum):
        return value.value
    return json.dumps(value) if isinstance(value, dict) else value


class NodeTable(Database):
    def ensure_nodes(self, nodes: Sequence[tuple[str, int]]) -> None:
        """Adds nodes the store does not know, in order; known nodes keep their state."""
        for position, (name, chips) in enumerate(nodes):
            self._execute(
                "INSERT INTO nodes (name, chips, state, position) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET chips = excluded.chips, position = excluded.position",
                (name, chips, NodeState.READY.value, position),
            )

    def nodes(self) -> list[NodeRow]:
        return [_node(r) for r in self._all("SELECT * FROM nodes ORDER BY position")]

    def node(self, name: str) -> NodeRow | None:
        row = self._one("SELECT * FROM nodes WHERE name = ?", (name,))
        return _node(row) if row is not None else None

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

    def set_heartbeats(self, heard: Mapping[str, float]) -> None:
        """When each node's agent was last heard (the record's "last heartbeat"), in one
        transaction: the controller writes them every few seconds, not one a heartbeat."""
        if not heard:
            return
        with self.transaction():
            self._db.executemany(
                "UPDATE nodes SET last_heartbeat = ? WHERE name = ?",
                [(at, name) for name, at in heard.items()],
            )


class JobTable(Database):
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
        with self.transaction():
            if self.move_job(job_id, JobStatus.PENDING, JobStatus.RUNNING, now) is None:
                return False
            self.update_job(job_id, attempt_started_at=now)
            return True

    def move_job(
        self,
        job_id: int,
        current: JobStatus,
        to: JobStatus,
        at: float,
        *,
        reason: str = "",
        cause: StopCause | None = None,
    ) -> dict[str, Any] | None:
        """The one writer of a job's status: `current` -> `to`, as the status machine allows
        (states.JOB_TRANSITIONS: IllegalJobMove otherwise), only if the job's status is still
        `current` (None where it is not: another writer came first). An end is written with its
        time, its `reason` and, for a stop, its `cause`; a stopped job carried on (`cause`: why
        it had stopped) loses them. Returns the columns written."""
        check_job_move(current, to, cause)
        fields: dict[str, Any] = {"status": to}
        if to.ended and to is not current:
            fields |= {"ended_at": at, "reason": reason, "stop_cause": None}
            fields |= {"stop_cause": cause} if to is JobStatus.STOPPED else {}
        elif current.ended:
            ended = {"ended_at": None, "reason": "", "stop_cause": None, "stop_requested": None}
            fields |= ended
        assignments = ", ".join(f"{k} = ?" for k in fields)
        cursor = self._execute(
            f"UPDATE jobs SET {assignments} WHERE id = ? AND status = ?",
            (*(_column(v) for v in fields.values()), job_id, current.value),
        )
        return fields if cursor.rowcount == 1 else None

    def reopen_to_resume(self, job_id: int, now: float) -> StopCause | None:
        """Stopped to be resumed (a hangup of its run's terminal, or for want of nodes:
        `StopCause.resumable`) -> Running again, for `relaunch run --resume`; why it had
        stopped, or None if the job was not stopped so."""
        with self.transaction():
            row = self._execute(
                "SELECT status, stop_cause FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            if row is None or row[0] != JobStatus.STOPPED.value or row[1] not in _CAUSES:
                return None
            cause = StopCause(row[1])
            if not cause.resumable:
                return None
            self.move_job(job_id, JobStatus.STOPPED, JobStatus.RUNNING, now, cause=cause)
            self.update_job(job_id, controller_seen_at=now)
            return cause

    def request_stop(self, job_id: int, reason: str, now: float) -> JobStatus:
        """A pending job stops at once; a running one is marked and its controller stops it."""
        with self.transaction():
            job = self.job(job_id)
            if job.status is JobStatus.PENDING:
                stopped, cause = JobStatus.STOPPED, StopCause.REQUEST
                self.move_job(job_id, job.status, stopped, now, reason=reason, cause=cause)
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
            r["left_behind"],
            StopCause(r["stop_cause"]) if r["stop_cause"] in _CAUSES else None,
        )

    def update_job(self, job_id: int, **fields: Any) -> None:
        """Writes a job's other fields; its status and its end only `move_job` writes."""
        ours = fields.keys() & _STATUS_FIELDS
        if ours:
            raise IllegalJobMove(f"{', '.join(sorted(ours))}: written by move_job only")
        if not fields:
            return
        assignments = ", ".join(f"{k} = ?" for k in fields)
        values = (_column(v) for v in fields.values())
        self._execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values, job_id))


class PodTable(Database):
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
        self.put_pods([pod])

    def put_pods(self, pods: Sequence[PodRow]) -> None:
        """Every row in one statement (a job-level recovery changes thousands)."""
        self._execute_many(
            "INSERT OR REPLACE INTO pods VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (p.job_id, p.idx, p.node, p.generation, p.schedule_cnt, p.proc_start_cnt, p.workdir)
                for p in pods
            ],
        )


def _node(r: sqlite3.Row) -> NodeRow:
    return NodeRow(
        r["name"],
        r["chips"],
        NodeState(r["state"]),
        r["isolated_at"],
        r["reason"],
        r["position"],
        tuple(json.loads(r["chip_faults"])),
        r["last_heartbeat"],
    )
