"""The `relaunch` command line: one module per group of commands, on one typer app."""

from __future__ import annotations

import errno
import importlib
import sqlite3
import sys

from relaunch.cli.common import EXIT_INVALID, app, err, say_error
from relaunch.errors import StoreError, StoreFull

__all__ = ["app", "main"]

for _group in ("validate", "run", "queue", "records", "nodes", "server", "bench"):
    importlib.import_module(f"relaunch.cli.{_group}")  # registers its commands, in this order


EXIT_DISK_FULL = 75
"""EX_TEMPFAIL: try again later (once space is freed); not 2, which says the input is bad."""


def main() -> None:
    try:
        app()
    except StoreFull as error:
        say_error(error)
        sys.exit(EXIT_DISK_FULL)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        err.print(
            f"[bold red]error:[/] the disk is full ({error}): free space, then "
            "`relaunch run --resume` carries the job on (its pods keep running for the adopt grace)",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(EXIT_DISK_FULL)
    except StoreError as error:
        say_error(error)
        sys.exit(EXIT_INVALID)
    except sqlite3.OperationalError as error:
        err.print(
            f"[bold red]error:[/] the state database: {error} (another relaunch may hold it "
            "busy; try again)",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(EXIT_INVALID)
