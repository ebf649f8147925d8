"""The job report: what `relaunch run --report` writes and `relaunch describe -o json` prints."""

from __future__ import annotations

import time
from typing import Any

from relaunch.diagnosis import Goodput, Recovery, failure_time, goodput
from relaunch.errors import InputError
from relaunch.faults import FaultKind, reschedule_reason
from relaunch.faults.plan import parse_plan
from relaunch.policy import Action, Budget
from relaunch.restores import restores
from relaunch.spec import parse_job
from relaunch.store import JobRow, NodeRow, RecordRow, Store

__all__ = [
    "budgets_left",
    "build_report",
    "job_goodput",
    "node_view",
    "plan_view",
    "reschedule_records",
]


def budgets_left(store: Store, job: JobRow) -> dict[str, int]:
    """What the job may still spend: the last recovery's count, or the spec's full budgets."""
    records = store.records(job.id)
    if records:
        return dict(records[-1].budgets)
    settings = parse_job(job.spec["raw"], source=job.spec.get("source", "stored job")).recovery
    return {
        "job": settings.job_retry_budget,
        "pod": settings.pod_retry_budget,
        "fault_retry": settings.fault_retry_times,
    }


def build_report(store: Store, job_id: int, now: float | None = None) -> dict[str, Any]:
    """`now`: the end of a job still running, for its goodput (default: the clock)."""
    now = time.time() if now is None else now
    job = store.job(job_id)
    records = store.records(job_id)
    pods = store.pods(job_id)
    isolated = sorted({node for r in records for node in r.isolated})
    return {
        "job": job.name,
        "id": job.id,
        "status": job.status.value,
        "reason": job.reason,
        "attempt": job.attempt,
        "last_step": job.last_step,
        "restarts_used": sum(1 for r in records if Budget.JOB in r.consumed),
        "pod_restarts_used": sum(1 for r in records if Budget.POD in r.consumed),
        "isolated_nodes": isolated,
        "left_behind": job.left_behind,
        "budgets_left": budgets_left(store, job),
        "created_at": job.created_at,
        "ended_at": job.ended_at,
        "pods": [
            {
                "name": f"{job.name}-pod-{p.idx}",
                "index": p.idx,
                "node": p.node,
                "generation": p.generation,
                "schedule_count": p.schedule_cnt,
                "proc_start_count": p.proc_start_cnt,
                "workdir": p.workdir,
            }
            for p in pods
        ],
        "recoveries": [r.to_json() for r in records],
        "restores": restores(store.events(job_id)),
        "reschedules": reschedule_records(job.name, records),
        "fault_plan": plan_view(store, job),
        "goodput": job_goodput(store, job, now).to_json(),
    }


RESCHEDULES = frozenset(a for a in Action if a.level.reschedules)
"""The levels that put pods (or processes) on other nodes or in new containers."""


def reschedule_records(job: str, records: list[RecordRow]) -> dict[str, Any]:
    """R-43, MindCluster's reschedule records: the total, and each reschedule's time and, for
    each pod its fault was on, the reason, the pod's name, its node and the rank."""
    entries = []
    for r in records:
        if r.action not in RESCHEDULES:
            continue
        fault = r.root_cause
        pods = (fault.pod,) if fault.pod is not None else r.pods
        entries.append(
            {
                "at": r.started_at,
                "action": r.action.value,
                "outcome": r.outcome.value,
                "pods": [
                    {
                        "reason": reschedule_reason(fault).value,
                        "pod": f"{job}-pod-{pod}",
                        "node": fault.node,
                        "rank": fault.rank,
                    }
                    for pod in pods
                ],
            }
        )
    return {"total": len(entries), "records": entries}


def job_goodput(store: Store, job: JobRow, now: float) -> Goodput:
    """Where the job's time went, from its submission to its end (or `now`)."""
    records = store.records(job.id)
    end = job.ended_at if job.ended_at is not None else now
    recoveries = []
    for i, r in enumerate(records):
        resumed = r.resumed_at
        if r.action is Action.IGNORE:
            resumed = r.detected_at  # recorded only: nothing was stopped
        elif resumed is None and i + 1 < len(records):
            resumed = records[i + 1].started_at  # a fallback took over: still recovering
        elif resumed is None and not job.status.ended:
            resumed = end  # under way
        happened = min(r.fault_at, failure_time(r.root_cause))
        slow = r.fault.kind is FaultKind.SLOW
        recoveries.append(Recovery(happened, r.detected_at, resumed, slow))
    return goodput(job.created_at, end, recoveries, store.progress(job.id))


def plan_view(store: Store, job: JobRow) -> list[dict[str, Any]]:
    """Each fault-plan entry and what became of it: fired (when), not fired (why), or pending."""
    try:
        entries = parse_plan(job.plan, source="stored fault plan") if job.plan else ()
    except InputError:
        return []
    done = store.fired(job.id)
    view = []
    for entry in entries:
        at, note = done.get(entry.index, (None, ""))
        state = "pending" if at is None else ("not fired" if note else "fired")
        view.append(
            {
                "index": entry.index,
                "entry": entry.describe(),
                "state": state,
                "at": at,
                "note": note.removeprefix("not fired: "),
            }
        )
    return view


def node_view(n: NodeRow) -> dict[str, Any]:
    return {
        "name": n.name,
        "state": n.state.value,
        "reason": n.reason,
        "chips": n.chips,
        "faulty_chips": list(n.chip_faults),
        "isolated_at": n.isolated_at,
        "last_heartbeat": n.last_heartbeat,
    }
