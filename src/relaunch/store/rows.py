"""What the store holds, as values: nodes, jobs, pods and recovery records, and their states."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from relaunch.diagnosis import failure_time, root_cause
from relaunch.diagnosis.errors import capped
from relaunch.faults import Cause, ErrorReport, Fault, FaultKind, Severity
from relaunch.policy import Action, Budget, Counters
from relaunch.states import JobStatus, NodeState, Outcome, StopCause

__all__ = [
    "JobRow",
    "JobStatus",
    "NodeRow",
    "NodeState",
    "Outcome",
    "PodRow",
    "RecordRow",
    "fault_from_json",
    "fault_to_json",
    "fault_view",
    "hang_view",
]


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
    left_behind: int | None = None
    """Processes its pods left in their cgroups when it ended, killed then (should be 0; None:
    not counted, pods were not cgroups, or the job has not ended)."""
    stop_cause: StopCause | None = None
    """Why it was stopped, where its status is Stopped."""

    @property
    def resumable(self) -> bool:
        """Stopped because its run's terminal closed (an accident), or for want of nodes on an
        engine whose nodes come back: `relaunch run --resume` carries it on."""
        cause = self.stop_cause
        return self.status is JobStatus.STOPPED and cause is not None and cause.resumable

    @property
    def ended_for_good(self) -> bool:
        """Succeeded, failed, or stopped in a way no `relaunch run --resume` carries on: what it
        kept on its nodes' disks may go."""
        return self.status.ended and not self.resumable


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
    others: tuple[tuple[Fault, float], ...] = ()
    """The other faults this recovery answered (collateral of `fault`), with when each was
    detected: ranks that failed because of the same cause."""
    evidence: dict[str, Any] | None = None
    """What diagnosis found when the fault was detected: a hang's stacks and culprit."""
    phase: str = "running"
    """Where the recovery is (controller.active.RecoveryPhase)."""
    state: dict[str, Any] = field(default_factory=dict)
    """What a resumed controller needs to carry the recovery on (controller.active)."""

    @property
    def root_cause(self) -> Fault:
        """The fault that happened first among this record's fault and its collateral."""
        return root_cause([self.fault, *(f for f, _ in self.others)])

    @property
    def collateral(self) -> list[Fault]:
        root = self.root_cause
        return [f for f in (self.fault, *(f for f, _ in self.others)) if f is not root]

    def to_json(self) -> dict[str, Any]:
        root = self.root_cause
        return {
            "fault": fault_view(root),
            "collateral": [fault_view(f) for f in self.collateral],
            "hang": hang_view(self.evidence) if self.fault.kind is FaultKind.HANG else None,
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


def fault_view(f: Fault) -> dict[str, Any]:
    """A fault as the report, the API and the dashboard show it."""
    error = f.error
    return {
        "kind": f.kind.value,
        "code": f.code,
        "node": f.node,
        "chip": f.chip,
        "pod": f.pod,
        "rank": f.rank,
        "exit_code": f.exit_code,
        "signal": f.signal,
        "duration_s": f.duration_s,
        "detail": f.detail,
        "failed_at": failure_time(f),
        "error": None
        if error is None
        else {
            "type": error.type,
            "message": error.message,
            "traceback": error.traceback,
            "source": error.source,
            "at": error.at,
        },
    }


def hang_view(evidence: dict[str, Any] | None) -> dict[str, Any] | None:
    """A hang's evidence as reported: its stacks in groups of alike ones, each with its ranks and
    their pids (a record written before the groups kept one stack a rank: each is a group of
    one)."""
    if evidence is None:
        return None
    stacks = [
        {
            "ranks": [s["rank"]],
            "pids": [s["pid"]],
            **{k: v for k, v in s.items() if k not in ("rank", "pid")},
        }
        if "rank" in s
        else s
        for s in evidence.get("stacks", [])
    ]
    return {**evidence, "stacks": stacks}


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
    error = data.get("error")
    data["error"] = capped(ErrorReport(**error)) if error else None  # stored by an older relaunch
    return Fault(**data)
