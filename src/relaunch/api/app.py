"""The REST API in the shape of ModelArts' training-job API, the dashboard and `/metrics`.

Thin, as ARCHITECTURE.md asks: handlers check the request, then read or write the store; the
runner and its controller act on what the store says. Every error is JSON with the same problems
`relaunch validate` prints::

    {"error_code": "RL.0400", "error_msg": "...", "problems": [{"key", "value", "allowed", "message"}]}
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime,
# and the dependencies they name are local to create_app.
import json
import os
import secrets
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from relaunch import __version__, runner
from relaunch.api import TOKEN_FILE
from relaunch.api.guard import MAX_BODY, Guard
from relaunch.api.metrics import StoreCollector
from relaunch.errors import MISSING, FaultPlanError, InputError, Problem
from relaunch.report import budgets_left, build_report, node_view
from relaunch.store import JOB_ID, JobRow, NodeState, Store

__all__ = [
    "ApiError",
    "ServerSettings",
    "create_app",
    "job_view",
    "load_or_create_token",
]


@dataclass(frozen=True)
class ServerSettings:
    state_dir: Path
    token: str
    cluster: Any = None
    """The cluster settings (as a cluster file holds them) that submitted jobs run on."""
    lock_reads: bool = False
    """Reads need the token too (they always do from other hosts than loopback)."""
    engine: Any = None
    """Where submitted jobs run: None for the embedded cluster, or Ray's stored settings."""


def load_or_create_token(state_dir: Path) -> tuple[str, bool]:
    """The server's bearer token and whether it was created now (mode 0600, never logged again)."""
    path = state_dir / TOKEN_FILE
    if path.exists():
        return path.read_text().strip(), False
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token, True


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, problems: tuple[Problem, ...] = (), code: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.problems = problems
        self.code = code or f"RL.{status:04d}"


class ProblemOut(BaseModel):
    key: str
    value: Any = None
    allowed: str
    message: str


class ErrorOut(BaseModel):
    error_code: str = Field(examples=["RL.0400"])
    error_msg: str
    problems: list[ProblemOut] = []


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
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "Invalid input; `problems` names every key."},
    401: {"model": ErrorOut, "description": "A bearer token is needed."},
    404: {"model": ErrorOut, "description": "No such job or node."},
    413: {"model": ErrorOut, "description": f"The body is larger than {MAX_BODY} bytes."},
    422: {
        "model": ErrorOut,
        "description": "A fault plan that cannot hit its targets in this job and cluster; "
        "`problems` names every entry.",
    },
}


def _problem_json(p: Problem) -> dict[str, Any]:
    value = None if p.value is MISSING else p.value
    try:
        json.dumps(value, allow_nan=False)  # what the response encoder will demand
    except (TypeError, ValueError, RecursionError):
        value = repr(value)[:200]
    return {"key": p.key, "value": value, "allowed": p.allowed, "message": str(p)}


def _error(
    status: int, message: str, problems: tuple[Problem, ...] = (), code: str = ""
) -> JSONResponse:
    body = {
        "error_code": code or f"RL.{status:04d}",
        "error_msg": message,
        "problems": [_problem_json(p) for p in problems],
    }
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(settings: ServerSettings) -> FastAPI:
    store = Store(settings.state_dir / "relaunch.db")
    bearer = HTTPBearer(
        auto_error=False, description="The token printed at the server's first start."
    )
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StoreCollector(store))

    app = FastAPI(
        title="relaunch",
        version=__version__,
        description="Training jobs that survive faults: the ModelArts training-job API shape, "
        "fault-recovery records, nodes and metrics.",
    )

    # The Guard middleware checks the token before any handler runs or any body is read; these
    # dependencies only put the bearer scheme into the OpenAPI document.
    def write_access(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        return None

    def read_access(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        return None

    app.add_middleware(
        Guard,
        token=settings.token,
        lock_reads=settings.lock_reads,
        protected=lambda path: path.startswith("/v2/") or path == "/metrics",
        token_file=str(settings.state_dir / TOKEN_FILE),
    )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, error: ApiError) -> JSONResponse:
        return _error(error.status, error.message, error.problems, error.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = []
        for e in error.errors():
            key = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            given = e.get("input")
            if isinstance(given, bytes | str) and key == "body":
                problems.append(
                    Problem(
                        key,
                        MISSING,
                        "a JSON body sent with `Content-Type: application/json`",
                        found="not a JSON object",
                    )
                )
            else:
                problems.append(Problem(key, given, e.get("msg", "invalid")))
        return _error(400, "invalid request", tuple(problems))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return _error(error.status_code, str(error.detail))

    def job_or_404(project_id: str, job_id: str) -> JobRow:
        row = store.find_job(job_id) if JOB_ID.fullmatch(job_id) else None
        if row is None or row.project != project_id:
            raise ApiError(404, f"no training job {job_id!r} in project {project_id!r}")
        return row

    Project = Annotated[str, PathParam(description="Any string: a namespace for jobs.")]
    JobId = Annotated[str, PathParam(description="The job's id, as `POST` returned it.")]

    # -- training jobs ------------------------------------------------------------------------------

    @app.post(
        "/v2/{project_id}/training-jobs",
        status_code=201,
        responses=ERRORS,
        dependencies=[Depends(write_access)],
        summary="Create a training job",
    )
    def create_job(
        project_id: Project,
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
        try:
            entries = runner.plan_entries(plan, source=f"{source}: fault_plan")
            job_id = runner.submit(
                store,
                runner.Submission(
                    raw=body,
                    source=source,
                    cwd=os.getcwd(),
                    cluster=settings.cluster,
                    plan=entries,
                    project=project_id,
                    engine=settings.engine,
                ),
                time.time(),
            )
        except InputError as error:
            raise _input_error(error) from None
        return job_view(store, store.job(job_id))

    @app.get(
        "/v2/{project_id}/training-jobs",
        responses=ERRORS,
        dependencies=[Depends(read_access)],
        summary="List training jobs",
    )
    def list_jobs(
        project_id: Project,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    ) -> dict[str, Any]:
        rows = [j for j in store.jobs() if j.project == project_id]
        rows.reverse()
        return {
            "count": len(rows),
            "items": [job_view(store, j, brief=True) for j in rows[offset : offset + limit]],
        }

    @app.get(
        "/v2/{project_id}/training-jobs/{training_job_id}",
        responses=ERRORS,
        dependencies=[Depends(read_access)],
        summary="Show a training job with its fault-recovery details",
    )
    def show_job(project_id: Project, training_job_id: JobId) -> dict[str, Any]:
        return job_view(store, job_or_404(project_id, training_job_id))

    @app.get(
        "/v2/{project_id}/training-jobs/{training_job_id}/recoveries",
        responses=ERRORS,
        dependencies=[Depends(read_access)],
        summary="The job's fault-recovery records",
    )
    def recoveries(project_id: Project, training_job_id: JobId) -> dict[str, Any]:
        row = job_or_404(project_id, training_job_id)
        items = build_report(store, row.id)["recoveries"]
        return {"count": len(items), "items": items}

    @app.get(
        "/v2/{project_id}/training-jobs/{training_job_id}/progress",
        responses=ERRORS,
        dependencies=[Depends(read_access)],
        summary="Training progress over time, with each fault and recovery",
    )
    def progress(
        project_id: Project,
        training_job_id: JobId,
        since: Annotated[float, Query(ge=0, le=1e12)] = 0.0,
    ) -> dict[str, Any]:
        row = job_or_404(project_id, training_job_id)
        return {
            "job_id": str(row.id),
            "samples": [{"at": at, "step": step} for at, step in store.progress(row.id, since)],
            "events": [{"at": at, "text": text} for at, text in store.events(row.id) if at > since],
        }

    @app.post(
        "/v2/{project_id}/training-jobs/{training_job_id}/actions",
        status_code=202,
        responses={**ERRORS, 409: {"model": ErrorOut, "description": "The job has ended."}},
        dependencies=[Depends(write_access)],
        summary="Act on a training job (`terminate`)",
    )
    def job_action(
        project_id: Project, training_job_id: JobId, action: JobAction
    ) -> dict[str, Any]:
        row = job_or_404(project_id, training_job_id)
        if action.action_type != "terminate":
            raise ApiError(
                400,
                "unknown action",
                (Problem("action_type", action.action_type, "terminate"),),
            )
        if row.status.ended:
            raise ApiError(409, f"job {row.id} has ended ({row.status.value})")
        store.request_stop(row.id, "terminated through the API", time.time())
        return job_view(store, store.job(row.id))

    @app.post(
        "/v2/{project_id}/training-jobs/{training_job_id}/faults",
        status_code=202,
        responses={**ERRORS, 409: {"model": ErrorOut, "description": "The job has ended."}},
        dependencies=[Depends(write_access)],
        summary="Inject a fault plan into a job (chaos testing)",
    )
    def inject(
        project_id: Project,
        training_job_id: JobId,
        plan: Annotated[
            dict[str, Any] | list[Any],
            Body(
                description="A fault plan, as a `--faults` file holds it: `{faults: [...]}` or "
                "a list. `after_s` counts from the start of the job's current attempt.",
                examples=[{"faults": [{"kind": "process-exit", "after_s": 0, "pod": 0}]}],
            ),
        ],
    ) -> CreatedFaults:
        row = job_or_404(project_id, training_job_id)
        if row.status.ended:
            raise ApiError(409, f"job {row.id} has ended ({row.status.value})")
        source = "fault plan"
        try:
            entries = runner.plan_entries(plan, source=source)
            if not entries:
                raise FaultPlanError(source, [Problem("faults", [], "at least one fault")])
            job, cluster = runner.stored_job(row)
            # numbered as they will be stored: after the entries the job already has
            offset = [*row.plan, *entries]
            runner.check_plan_fits(offset, job, cluster, source)
        except InputError as error:
            raise _input_error(error) from None
        first = store.append_plan(row.id, entries)
        return CreatedFaults(job_id=str(row.id), first_index=first, count=len(entries))

    # -- nodes --------------------------------------------------------------------------------------

    @app.get(
        "/v2/nodes", dependencies=[Depends(read_access)], responses=ERRORS, summary="List nodes"
    )
    def list_nodes() -> dict[str, Any]:
        items = [node_view(n) for n in store.nodes()]
        return {"count": len(items), "items": items}

    def node_action(name: str, state: NodeState, reason: str) -> dict[str, Any]:
        if store.node(name) is None:
            raise ApiError(404, f"no node {name!r}; see GET /v2/nodes")
        store.set_node_state(name, state, reason, time.time())
        node = store.node(name)
        assert node is not None
        return node_view(node)

    @app.post(
        "/v2/nodes/{node_name}/cordon",
        dependencies=[Depends(write_access)],
        responses=ERRORS,
        summary="Isolate a node: no new pods go there",
    )
    def cordon(node_name: str) -> dict[str, Any]:
        return node_action(node_name, NodeState.ISOLATED, "cordoned by an operator")

    @app.post(
        "/v2/nodes/{node_name}/release",
        dependencies=[Depends(write_access)],
        responses=ERRORS,
        summary="Release an isolated node back to Ready",
    )
    def release(node_name: str) -> dict[str, Any]:
        return node_action(node_name, NodeState.READY, "released by an operator")

    # -- metrics, health, dashboard ---------------------------------------------------------------

    @app.get(
        "/metrics",
        dependencies=[Depends(read_access)],
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={401: ERRORS[401]},
    )
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", summary="Liveness")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    static = resources.files("relaunch.api") / "static"

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse((static / "index.html").read_text())

    app.mount("/static", StaticFiles(packages=[("relaunch.api", "static")]), name="static")
    return app


def _input_error(error: InputError) -> ApiError:
    """400 for a job that is not valid; 422 for a fault plan that is not valid or does not fit
    its job (the request was well formed, its faults cannot happen)."""
    status = 422 if isinstance(error, FaultPlanError) else 400
    return ApiError(status, f"{error.source}: invalid {error.what}", error.problems)


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
    }
    return view
