"""A job as the API shows it: ModelArts' metadata / spec / status, with relaunch's recovery state."""

from __future__ import annotations

import time
from typing import Any

from relaunch.report import budgets_left, build_report
from relaunch.store import JobRow, Store

__all__ = ["job_view"]


def job_view(store: Store, row: JobRow, brief: bool = False) -> dict[str, Any]:
    """A job as ModelArts shows one (metadata / spec / status), with relaunch's recovery state."""
    raw = row.spec.get("raw") or {}
    metadata = raw.get("metadata") if isinstance(raw, dict) else {}
    metadata = metadata if isinstance(metadata, dict) else {}
    end = row.ended_at or time.time()
    view: dict[str, Any] = {
        "kind": "job",
        "metadata": {
            "id": str(row.id),
            "name": row.name,
            "project_id": row.project,
            "create_time": int(row.created_at * 1000),
            "annotations": metadata.get("annotations") or {},
            "labels": metadata.get("labels") or {},
        },
        "status": {
            "phase": row.status.value,
            "reason": row.reason,
            "duration": int((end - row.created_at) * 1000),
            "attempt": row.attempt,
            "last_step": row.last_step,
            "stop_requested": row.stop_requested,
        },
    }
    if brief:
        view["status"]["recoveries"] = len(store.records(row.id))
        return view
    report = build_report(store, row.id)
    view["spec"] = raw.get("spec") if isinstance(raw, dict) else None
    view["fault_plan"] = row.plan
    view["recovery"] = {
        "restarts_used": report["restarts_used"],
        "pod_restarts_used": report["pod_restarts_used"],
        "budgets_left": budgets_left(store, row),
        "isolated_nodes": report["isolated_nodes"],
        "pods": report["pods"],
        "records": report["recoveries"],
        "fault_plan": report["fault_plan"],
        "goodput": report["goodput"],
        "restores": report["restores"],
    }
    return view
