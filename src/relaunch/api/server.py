"""`relaunch server`: the API and dashboard, and a keeper that hands queued jobs to a runner."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import uvicorn

from relaunch.api.app import ServerSettings, create_app
from relaunch.errors import RelaunchError
from relaunch.runner import ensure_runner

__all__ = ["serve"]


def _reap() -> None:
    """Collect runners that ended (they are this process's children)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _keep_runner(settings: ServerSettings, interval_s: float, log: Callable[[str], None]) -> None:
    """Level-triggered: whenever jobs wait (or a runner died mid-job), make sure one runs."""
    stop = threading.Event()
    while not stop.wait(interval_s):
        _reap()
        try:
            state = ensure_runner(settings.state_dir)
        except (OSError, RelaunchError) as error:
            log(f"could not start a runner: {error}")
            continue
        if state.started is not None:
            log(
                f"runner started (pid {state.started}); its log: "
                f"{settings.state_dir / 'runner.log'}"
            )


def serve(
    settings: ServerSettings,
    host: str,
    port: int,
    *,
    paused: bool,
    log: Callable[[str], None],
    runner_interval_s: float = 0.5,
) -> None:
    app = create_app(settings)
    if not paused:
        threading.Thread(
            target=_keep_runner, args=(settings, runner_interval_s, log), daemon=True
        ).start()
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
