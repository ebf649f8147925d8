"""`relaunch ARGS` run in the test's own process: typer's CliRunner on the real app, through the
same commands and error handling a shell reaches, without an interpreter's start (0.8 s alone,
up to 2.7 s beside another test on two cores: 46 validations took 56 s of the suite). For the
commands that start nothing (validate, faults, --version); each file that uses it keeps one run
of the real `relaunch` process, and commands that start processes always run as real ones."""

from __future__ import annotations

import contextlib
import subprocess
import traceback
from pathlib import Path

from typer.testing import CliRunner

from relaunch.cli import app

__all__ = ["relaunch_here"]


def relaunch_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """What the shell would get of `relaunch ARGS` (in `cwd`): exit code, stdout and stderr
    apart; an exception the command let escape shows in stderr as the traceback a process
    would print."""
    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        result = CliRunner().invoke(app, list(args), color=False)
    stderr = result.stderr
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(["relaunch", *args], result.exit_code, result.stdout, stderr)
