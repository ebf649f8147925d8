"""`relaunch ARGS` run in the test's own process: click's CliRunner on `relaunch.cli.main`, the
entry point a shell reaches (its commands and its handling of the errors they let escape: a
damaged state database, a full disk), without an interpreter's start (0.8 s alone, up to 2.7 s
beside another test on two cores: 46 validations took 56 s of the suite). For the commands that
start nothing (validate, faults, reading the records, --version); each file that uses it keeps
one run of the real `relaunch` process, and commands that start processes always run as real
ones."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import traceback
from pathlib import Path
from unittest import mock

import click
from click.testing import CliRunner

from relaunch.cli import main

__all__ = ["relaunch_here"]


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def _shell(args: tuple[str, ...]) -> None:
    """`relaunch ARGS` as the console script runs it: main() reads sys.argv."""
    with mock.patch.object(sys, "argv", ["relaunch", *args]):
        main()


def relaunch_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """What the shell would get of `relaunch ARGS` (in `cwd`): exit code, stdout and stderr
    apart; an exception the command let escape shows in stderr as the traceback a process
    would print."""
    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        result = CliRunner().invoke(_shell, list(args), color=False)
    stderr = result.stderr
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(["relaunch", *args], result.exit_code, result.stdout, stderr)
