"""The server's application: the REST API in the shape of ModelArts' training-job API, the
dashboard and `/metrics`, over the same store as `relaunch run`.

Thin, as docs/architecture.md says: the Guard checks every request first; routes check what they are
given and call the service (relaunch.service); the runner and its controller act on what the
store says. Every error is JSON with the problems `relaunch validate` prints (api.errors).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry

from relaunch import __version__
from relaunch.api import TOKEN_FILE, errors
from relaunch.api.deps import ServerSettings
from relaunch.api.guard import Guard
from relaunch.api.metrics import StoreCollector
from relaunch.api.routes import jobs, nodes, site
from relaunch.api.views import job_view
from relaunch.protocol.layout import StateDir
from relaunch.store import Store

__all__ = ["ServerSettings", "create_app", "job_view", "load_or_create_token"]


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


def create_app(settings: ServerSettings) -> FastAPI:
    app = FastAPI(
        title="relaunch",
        version=__version__,
        description="Training jobs that survive faults: the ModelArts training-job API shape, "
        "fault-recovery records, nodes and metrics.",
    )
    store = Store(StateDir(settings.state_dir).db)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StoreCollector(store))
    app.state.store, app.state.settings, app.state.registry = store, settings, registry
    app.add_middleware(
        Guard,
        token=settings.token,
        lock_reads=settings.lock_reads,
        protected=lambda path: path.startswith("/v2/") or path == "/metrics",
        token_file=str(settings.state_dir / TOKEN_FILE),
    )
    errors.install(app)
    for router in (jobs.router, nodes.router, site.router):
        app.include_router(router)
    app.mount("/static", StaticFiles(packages=[("relaunch.api", "static")]), name="static")
    return app
