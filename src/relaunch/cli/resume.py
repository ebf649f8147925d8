"""`relaunch run --resume`: which job it carries on (one whose controller died, or one its
terminal's hangup stopped)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relaunch.errors import InputError, Problem
from relaunch.states import HANGUP
from relaunch.store import JobRow, JobStatus, Store

__all__ = ["hung_up", "unfinished"]


def unfinished(store: Store, ref: Path | None, document: tuple[dict[str, Any], str] | None) -> Any:
    """The unfinished job `ref` names (the newest, without one) to resume."""
    if document is not None:
        raise InputError(
            "relaunch run --resume",
            [Problem("SCRIPT", str(ref), "the job's name or id, with --resume")],
        )
    jobs = [j for j in store.jobs() if j.status.active or hung_up(j)]
    if ref is not None:
        jobs = [j for j in jobs if j.name == str(ref) or str(j.id) == str(ref)]
    if not jobs:
        raise InputError(
            "relaunch run --resume",
            [
                Problem(
                    "JOB",
                    str(ref or ""),
                    "an unfinished job in this state directory (or one its terminal's "
                    "hangup stopped)",
                )
            ],
        )
    return jobs[-1]


def hung_up(job: JobRow) -> bool:
    """Stopped because its run's terminal closed: an accident, which --resume carries on."""
    return job.status is JobStatus.STOPPED and job.reason.endswith(HANGUP)
