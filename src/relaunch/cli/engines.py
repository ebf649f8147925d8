"""--engine: the engine a command's jobs run on, found by name (relaunch.engines)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from relaunch import engines
from relaunch.cli.common import EXIT_INVALID, err, out
from relaunch.engines import EngineKind, Trial
from relaunch.errors import EngineError

__all__ = ["SimulateChipsOption", "engine_kind", "say", "stop_trial"]

SimulateChipsOption = Annotated[
    bool,
    typer.Option(
        "--simulate-chips",
        help="Simulated chips on the embedded cluster even where this machine has NVIDIA GPUs "
        "(no pod is given a GPU). Without it, the chips are the machine's GPUs where it has "
        "any, and a cluster of more chips than GPUs is refused.",
    ),
]


def engine_kind(given: str) -> EngineKind:
    """The engine named by --engine (exit 2 naming every engine where none has that name)."""
    try:
        return engines.kind(given)
    except EngineError as error:
        err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
        raise typer.Exit(EXIT_INVALID) from None


def say(text: str) -> None:
    """An engine's word while it places a job (a trial cluster starting, an allocation read)."""
    out.print(f"[bold cyan]\\[relaunch][/] {escape(text)}", highlight=False)


def stop_trial(trial: Trial | None) -> None:
    if trial is not None:
        trial.stop()
