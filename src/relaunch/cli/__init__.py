"""The `relaunch` command line: one module per group of commands, on one typer app."""

from __future__ import annotations

import importlib
import sqlite3
import sys

from relaunch.cli.common import EXIT_INVALID, app, err
from relaunch.errors import StoreError

__all__ = ["app", "main"]

for _group in ("validate", "run", "queue", "records", "nodes", "server", "bench"):
    importlib.import_module(f"relaunch.cli.{_group}")  # registers its commands, in this order


def main() -> None:
    try:
        app()
    except StoreError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_INVALID)
    except sqlite3.OperationalError as error:
        err.print(
            f"[bold red]error:[/] the state database: {error} (another relaunch may hold it "
            "busy; try again)",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(EXIT_INVALID)
