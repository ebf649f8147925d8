"""The job report: what `relaunch run --report` writes and `relaunch describe -o json` prints."""

from __future__ import annotations

from typing import Any

from relaunch.policy import Budget
from relaunch.store import Store

__all__ = ["build_report"]


def build_report(store: Store, job_id: int) -> dict[str, Any]:
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
    }
