"""Faults, the decisions they wait for, recovery records, fault-plan outcomes and events."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from relaunch.events import Event, EventKind, Recorded
from relaunch.faults import Cause, Fault
from relaunch.policy import Action, Budget, Counters, Decision, JobHistory, RecoveryRecord
from relaunch.store.database import Database
from relaunch.store.rows import Outcome, PodRow, RecordRow, fault_from_json, fault_to_json
from relaunch.store.tables import PodTable

__all__ = ["EventTable", "RecordTable"]


class RecordTable(PodTable):
    def add_fault(
        self,
        job_id: int,
        fault: Fault,
        detected_at: float,
        source: str = "",
        collateral_of: int | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> int | None:
        """Stores an observed fault; None if a fault from the same source was stored before.
        `collateral_of`: the fault whose recovery answers this one too (diagnosis.rootcause);
        `evidence`: what diagnosis found (a hang's stacks)."""
        row = self._one(
            "INSERT OR IGNORE INTO faults (job_id, fault, at, detected_at, source, collateral_of, "
            "evidence) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (
                job_id,
                fault_to_json(fault),
                fault.at,
                detected_at,
                source,
                collateral_of,
                None if evidence is None else json.dumps(evidence),
            ),
        )
        return None if row is None else int(row["id"])

    def make_collateral(self, job_id: int, fault_id: int, of: int) -> None:
        """A fault that waited for a decision is `of`'s collateral after all (the recovery of
        `of`, decided first, answers it): it waits no more."""
        with self.transaction():
            self._execute(
                "UPDATE faults SET collateral_of = ? WHERE job_id = ? AND id = ?",
                (of, job_id, fault_id),
            )
            self._execute(
                "DELETE FROM pending_decisions WHERE job_id = ? AND fault_id = ?",
                (job_id, fault_id),
            )

    def has_fault_from(self, job_id: int, source_prefix: str) -> bool:
        """Whether a fault whose source starts with `source_prefix` was stored for the job."""
        escaped = source_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        row = self._one(
            "SELECT 1 FROM faults WHERE job_id = ? AND source LIKE ? ESCAPE '\\' LIMIT 1",
            (job_id, escaped + "%"),
        )
        return row is not None

    def faults(self, job_id: int, before: int | None = None) -> list[Fault]:
        """The faults that were decided (collateral ones are not: their group's fault was)."""
        rows = self._all(
            "SELECT fault FROM faults WHERE job_id = ? AND id < ? AND collateral_of IS NULL "
            "ORDER BY id",
            (job_id, before if before is not None else 2**62),
        )
        return [fault_from_json(r["fault"]) for r in rows]

    def collateral(self, job_id: int) -> dict[int, list[tuple[Fault, float]]]:
        """Each fault's collateral faults, with when each was detected."""
        rows = self._all(
            "SELECT collateral_of, fault, detected_at FROM faults "
            "WHERE job_id = ? AND collateral_of IS NOT NULL ORDER BY id",
            (job_id,),
        )
        found: dict[int, list[tuple[Fault, float]]] = {}
        for r in rows:
            found.setdefault(int(r["collateral_of"]), []).append(
                (fault_from_json(r["fault"]), float(r["detected_at"]))
            )
        return found

    def add_record(
        self,
        job_id: int,
        fault_id: int,
        decision: Decision,
        tried: Sequence[Action],
        budgets: Mapping[str, int],
        started_at: float,
        phase: str,
        outcome: Outcome,
        state: Mapping[str, Any],
    ) -> int:
        """A recovery record: the decision taken for a fault, what had been tried before it,
        the budgets left after it, its phase and the outcome that follows from it, and what a
        resumed controller needs to carry it on (written by controller.active only)."""
        row = self._one(
            "INSERT INTO recoveries (job_id, fault_id, action, cause, reason, pods, isolated, consumed, "
            "tried, counters, budgets, started_at, phase, outcome, state) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
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
                phase,
                outcome.value,
                json.dumps(dict(state)),
            ),
        )
        assert row is not None
        return int(row["id"])

    def set_recovery_phase(
        self,
        record_id: int,
        phase: str,
        outcome: Outcome,
        state: Mapping[str, Any],
        resumed_at: float | None = None,
        fault_at: float | None = None,
    ) -> None:
        """A recovery's new phase with the outcome that follows from it, its state, and when
        progress resumed (its MTTR): one statement (written by controller.active only)."""
        mttr = None if resumed_at is None or fault_at is None else round(resumed_at - fault_at, 3)
        self._execute(
            "UPDATE recoveries SET phase = ?, outcome = ?, state = ?, resumed_at = ?, mttr_s = ? "
            "WHERE id = ?",
            (phase, outcome.value, json.dumps(dict(state)), resumed_at, mttr, record_id),
        )

    def save_recovery_state(self, record_id: int, state: Mapping[str, Any]) -> None:
        """What a resumed controller needs to carry a recovery on; its phase unchanged."""
        self._execute(
            "UPDATE recoveries SET state = ? WHERE id = ?", (json.dumps(dict(state)), record_id)
        )

    def records(self, job_id: int) -> list[RecordRow]:
        rows = self._all(
            "SELECT r.*, f.fault AS fault_json, f.at AS fault_at, f.detected_at AS detected_at, "
            "f.evidence AS evidence "
            "FROM recoveries r JOIN faults f ON f.id = r.fault_id WHERE r.job_id = ? ORDER BY r.id",
            (job_id,),
        )
        collateral = self.collateral(job_id)
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
                others=tuple(collateral.get(r["fault_id"], ())),
                evidence=json.loads(r["evidence"]) if r["evidence"] else None,
                phase=r["phase"],
                state=json.loads(r["state"]),
            )
            for r in rows
        ]

    def history(
        self, job_id: int, before_fault: int | None = None, pods: Sequence[PodRow] | None = None
    ) -> JobHistory:
        """The policy's view of the job's past, rebuilt from the records; `before_fault` leaves
        out the fault being decided and any after it. `pods`: the job's pods as the caller holds
        them (the controller: thousands of rows it need not read again)."""
        pods = self.pods(job_id) if pods is None else pods
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
                fault_id=r.fault_id,
            )
            for r in self.records(job_id)
        )
        return JobHistory(
            pods=len(pods),
            faults=tuple(self.faults(job_id, before_fault)),
            records=records,
            counters=tuple(p.counters for p in pods),
        )


class EventTable(Database):
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

    def event(self, job_id: int | None, event: Event, at: float | None = None) -> None:
        """Records `event`: its kind and fields, and its sentence for a person (and for an older
        relaunch reading this state directory)."""
        self._execute(
            "INSERT INTO events (job_id, at, text, kind, fields) VALUES (?, ?, ?, ?, ?)",
            (job_id, at or time.time(), event.text, event.kind.value, _encode(event.fields)),
        )

    def events(self, job_id: int) -> list[Recorded]:
        """The job's events, in order."""
        rows = self._all(
            "SELECT at, text, kind, fields FROM events WHERE job_id = ? ORDER BY id", (job_id,)
        )
        return [_recorded(r) for r in rows]

    def events_of(self, kind: EventKind) -> list[Recorded]:
        """Every job's events of `kind`, in order."""
        rows = self._all(
            "SELECT at, text, kind, fields FROM events WHERE kind = ? ORDER BY id", (kind.value,)
        )
        return [_recorded(r) for r in rows]


_encode = msgspec.json.Encoder().encode


def _recorded(row: Any) -> Recorded:
    kind = row["kind"]
    return Recorded(
        row["at"],
        _KINDS.get(kind),
        json.loads(row["fields"]),
        row["text"],
    )


_KINDS: dict[str, EventKind] = {kind.value: kind for kind in EventKind}
