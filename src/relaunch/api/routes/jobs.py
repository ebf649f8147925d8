"""Training jobs, in the shape of ModelArts' training-job API."""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time.
import os
import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query
from fastapi import Path as PathParam
from pydantic import BaseModel, Field

from relaunch import service
from relaunch.api.deps import ServerSettings, StoreDep, auth, settings_of
from relaunch.api.errors import ENDED, ERRORS, ApiError
from relaunch.api.views import job_view
from relaunch.errors import Problem
from relaunch.report import build_report
from relaunch.store import JOB_ID, JobRow, Store

__all__ = ["router"]

router = APIRouter(prefix="/v2/{project_id}/training-jobs", dependencies=[Depends(auth)])

Project = Annotated[str, PathParam(description="Any string: a namespace for jobs.")]
JobId = Annotated[str, PathParam(description="The job's id, as `POST` returned it.")]


class JobAction(BaseModel):
    action_type: str = Field(
        description="`terminate` stops the job (its pods get the termination grace period).",
        examples=["terminate"],
    )


class CreatedFaults(BaseModel):
    job_id: str
    first_index: int
    count: int


JOB_EXAMPLE = {
    "kind": "job",
    "metadata": {
        "name": "demo",
        "annotations": {
            "fault-tolerance/job-retry-num": "8",
            "fault-tolerance/job-unconditional-retry": "true",
            "fault-tolerance/hang-retry": "true",
            "fault-tolerance/pod-retry-num": "3",
        },
    },
    "spec": {"replicas": 2, "command": "python examples/train_toy.py --steps 60"},
    "fault_plan": [{"kind": "process-exit", "at_step": 20, "pod": 1, "exit_code": 1}],
}


def job_of(store: Store, project_id: str, job_id: str) -> JobRow:
    """The job, or 404: ids are ASCII digits ('²' is a digit to str.isdigit)."""
    if not JOB_ID.fullmatch(job_id):
        raise ApiError(404, f"no training job {job_id!r} in project {project_id!r}")
    try:
        return service.find_job(store, job_id, project_id)
    except service.NotFound:
        raise ApiError(404, f"no training job {job_id!r} in project {project_id!r}") from None


@router.post("", status_code=201, responses=ERRORS, summary="Create a training job")
def create_job(
    project_id: Project,
    store: StoreDep,
    settings: Annotated[ServerSettings, Depends(settings_of)],
    payload: Annotated[
        dict[str, Any],
        Body(
            description="A ModelArts-shaped job (`kind`, `metadata.name`, "
            "`metadata.annotations`, `metadata.labels`, `spec` with `command`), plus "
            "relaunch's optional `fault_plan`: faults to inject, as in a `--faults` file.",
            examples=[JOB_EXAMPLE],
        ),
    ],
) -> dict[str, Any]:
    body = dict(payload)
    plan = body.pop("fault_plan", None)
    source = f"POST /v2/{project_id}/training-jobs"
    submission = service.Submission(
        raw=body,
        source=source,
        cwd=os.getcwd(),
        cluster=settings.cluster,
        plan=service.plan_entries(plan, source=f"{source}: fault_plan"),
        project=project_id,
        engine=settings.engine,
    )
    job_id = service.submit(store, submission, time.time())
    return job_view(store, store.job(job_id))


@router.get("", responses=ERRORS, summary="List training jobs")
def list_jobs(
    project_id: Project,
    store: StoreDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> dict[str, Any]:
    rows = [j for j in store.jobs() if j.project == project_id]
    rows.reverse()
    return {
        "count": len(rows),
        "items": [job_view(store, j, brief=True) for j in rows[offset : offset + limit]],
    }


@router.get(
    "/{training_job_id}",
    responses=ERRORS,
    summary="Show a training job with its fault-recovery details",
)
def show_job(project_id: Project, training_job_id: JobId, store: StoreDep) -> dict[str, Any]:
    return job_view(store, job_of(store, project_id, training_job_id))


@router.get(
    "/{training_job_id}/recoveries",
    responses=ERRORS,
    summary="The job's fault-recovery records",
)
def recoveries(project_id: Project, training_job_id: JobId, store: StoreDep) -> dict[str, Any]:
    row = job_of(store, project_id, training_job_id)
    items = build_report(store, row.id)["recoveries"]
    return {"count": len(items), "items": items}


@router.get(
    "/{training_job_id}/progress",
    responses=ERRORS,
    summary="Training progress over time, with each fault and recovery",
)
def progress(
    project_id: Project,
    training_job_id: JobId,
    store: StoreDep,
    since: Annotated[float, Query(ge=0, le=1e12)] = 0.0,
) -> dict[str, Any]:
    row = job_of(store, project_id, training_job_id)
    return {
        "job_id": str(row.id),
        "samples": [{"at": at, "step": step} for at, step in store.progress(row.id, since)],
        "events": [
            {"at": e.at, "kind": e.kind, "fields": e.fields, "text": e.text}
            for e in store.events(row.id)
            if e.at > since
        ],
    }


@router.post(
    "/{training_job_id}/actions",
    status_code=202,
    responses={**ERRORS, **ENDED},
    summary="Act on a training job (`terminate`)",
)
def job_action(
    project_id: Project, training_job_id: JobId, action: JobAction, store: StoreDep
) -> dict[str, Any]:
    row = job_of(store, project_id, training_job_id)
    if action.action_type != "terminate":
        raise ApiError(
            400, "unknown action", (Problem("action_type", action.action_type, "terminate"),)
        )
    service.stop_job(store, row, "terminated through the API", time.time())
    return job_view(store, store.job(row.id))


@router.post(
    "/{training_job_id}/faults",
    status_code=202,
    responses={**ERRORS, **ENDED},
    summary="Inject a fault plan into a job (a rehearsal of its faults)",
)
def inject(
    project_id: Project,
    training_job_id: JobId,
    store: StoreDep,
    plan: Annotated[
        dict[str, Any] | list[Any],
        Body(
            description="A fault plan, as a `--faults` file holds it: `{faults: [...]}` or "
            "a list. `after_s` counts from the start of the job's current attempt.",
            examples=[{"faults": [{"kind": "process-exit", "after_s": 0, "pod": 0}]}],
        ),
    ],
) -> CreatedFaults:
    row = job_of(store, project_id, training_job_id)
    first, count = service.add_faults(store, row, plan, "fault plan")
    return CreatedFaults(job_id=str(row.id), first_index=first, count=count)
