"""`relaunch run --resume`: which job it carries on (one whose controller died, one its
terminal's hangup stopped, or one stopped for want of nodes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relaunch.errors import InputError, Problem
from relaunch.store import Store

__all__ = ["unfinished"]


def unfinished(store: Store, ref: Path | None, document: tuple[dict[str, Any], str] | None) -> Any:
    """The unfinished job `ref` names (the newest, without one) to resume."""
    if document is not None:
        raise InputError(
            "relaunch run --resume",
            [Problem("SCRIPT", str(ref), "the job's name or id, with --resume")],
        )
    jobs = [j for j in store.jobs() if j.status.active or j.resumable]
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
