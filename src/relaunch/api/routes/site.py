"""Metrics, liveness and the dashboard's page."""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time.
from importlib import resources

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from relaunch import __version__
from relaunch.api.deps import auth
from relaunch.api.errors import ERRORS

__all__ = ["router"]

router = APIRouter()


@router.get(
    "/metrics",
    dependencies=[Depends(auth)],
    summary="Prometheus metrics",
    response_class=PlainTextResponse,
    responses={401: ERRORS[401]},
)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", summary="Liveness")
def healthz() -> dict[str, str]:
    return {"status": "ok", "version": __version__}


@router.get("/", include_in_schema=False)
def index() -> HTMLResponse:
    return HTMLResponse((resources.files("relaunch.api") / "static" / "index.html").read_text())
