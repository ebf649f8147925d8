"""What the commands share: the consoles, the options, the state directory, errors."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from relaunch import __version__
from relaunch.api import TOKEN_FILE
from relaunch.errors import InputError
from relaunch.protocol.environment import Env
from relaunch.protocol.layout import StateDir
from relaunch.states import StopCause
from relaunch.store import JobRow, JobStatus, Store

if TYPE_CHECKING:
    from relaunch.api.client import Client


app = typer.Typer(
    name="relaunch",
    help="Keep distributed training jobs alive through faults.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True)


EXIT_INVALID = 2
EXIT_WANTS_NODES = StopCause.WANTS_NODES.exit_code
"""`relaunch run`'s exit when its job stopped for want of nodes (StopCause.WANTS_NODES): an sbatch
script requeues its job on it, and the requeued job resumes (docs/slurm.md)."""

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Characters a terminal acts on instead of showing: ESC (colours, a title change, a clear
screen, OSC 52 writing the clipboard), a bell, a backspace, a carriage return, C1's CSI."""


def visible(text: str) -> str:
    """A rank's text as a terminal may safely show it: each control character written out as
    `\\xNN` (newlines and tabs kept). Bytes that were not UTF-8 were read as U+FFFD."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


def visible_all(data: Any) -> Any:
    """`visible` applied to every string in a report (dicts, lists, strings)."""
    if isinstance(data, str):
        return visible(data)
    if isinstance(data, dict):
        return {key: visible_all(value) for key, value in data.items()}
    if isinstance(data, list):
        return [visible_all(item) for item in data]
    return data


def _print_version(value: bool) -> None:
    if value:
        out.print(f"relaunch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the version and exit.",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Keep distributed training jobs alive through faults."""


def say_error(error: object) -> None:
    """One error, on stderr, on one line however narrow the terminal (its text is not markup)."""
    err.print("[bold red]error:[/] ", end="", highlight=False)
    err.print(str(error), markup=False, highlight=False, soft_wrap=True)


def fail_input(error: InputError) -> typer.Exit:
    err.print(
        f"[bold red]error:[/] {error.source}: invalid {error.what}", highlight=False, soft_wrap=True
    )
    for problem in error.problems:
        err.print(f"  - {problem}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_INVALID)


FaultTableOption = Annotated[
    Path | None,
    typer.Option("--fault-table", help="YAML/JSON file that overrides fault codes and escalation."),
]


def duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


AddressOption = Annotated[
    str | None,
    typer.Option(
        "--address",
        help="With --engine ray: the running Ray cluster to use; with --engine agents: "
        "HOST:PORT the controller listens on, which the agents were given; with --engine "
        "kubernetes: the address the nodes reach the controller at (default 127.0.0.1).",
    ),
]
KubeconfigOption = Annotated[
    Path | None,
    typer.Option(
        "--kubeconfig",
        help="With --engine kubernetes: the cluster's kubeconfig (default: $KUBECONFIG).",
    ),
]
NamespaceOption = Annotated[
    str | None,
    typer.Option(
        "--namespace",
        help="With --engine kubernetes: the namespace of the job's Pods and Lease (default: "
        "default).",
    ),
]
RaySelectOption = Annotated[
    str | None,
    typer.Option(
        "--ray-select",
        help="With --engine ray: use only nodes carrying this resource or label (KEY or "
        "KEY=VALUE).",
    ),
]
StateDirOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        envvar=Env.STATE_DIR,
        help="Where jobs, nodes and records are kept (default ~/.local/state/relaunch).",
    ),
]


def state_dir_of(path: Path | None) -> Path:
    """The state directory, created readable by its owner only (it holds every job's spec,
    environment and logs, and the server's token)."""
    if path is None:
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        path = base / "relaunch"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path.resolve()


def open_store(state_dir: Path | None) -> Store:
    return Store(StateDir(state_dir_of(state_dir)).db)


def job_or_exit(store: Store, ref: str) -> JobRow:
    row = store.find_job(ref)
    if row is None:
        err.print(f"[bold red]error:[/] no job {ref!r}; see `relaunch jobs`", highlight=False)
        raise typer.Exit(EXIT_INVALID)
    return row


def node_or_exit(store: Store, name: str) -> None:
    if store.node(name) is None:
        err.print(f"[bold red]error:[/] no node {name!r}; see `relaunch nodes`", highlight=False)
        raise typer.Exit(EXIT_INVALID)


ServerOption = Annotated[
    str | None,
    typer.Option(
        "--server",
        envvar=Env.SERVER,
        help="Talk to this relaunch server (http://host:port) instead of the local state.",
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar=Env.TOKEN,
        help="The server's bearer token (default: the state directory's server-token file).",
    ),
]
ProjectOption = Annotated[
    str, typer.Option("--project", help="The server's project (a namespace for jobs).")
]


def client_for(server: str, token: str | None, state_dir: Path | None, project: str) -> Client:
    from relaunch.api.client import Client

    if token is None:
        candidate = state_dir_of(state_dir) / TOKEN_FILE
        if candidate.exists() and os.access(candidate, os.R_OK):
            token = candidate.read_text().strip()
    return Client(server, token, project)


def remote(call: Callable[[], Any]) -> Any:
    from relaunch.api.client import ClientError

    try:
        return call()
    except ClientError as error:
        say_error(error)
        for problem in error.problems:
            err.print(f"  - {problem}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INVALID) from None


def exit_code(status: JobStatus, cause: StopCause | None) -> int:
    """0 succeeded, 1 failed or stopped, 130 / 143 / 129 stopped by Ctrl-C / SIGTERM / SIGHUP,
    3 stopped for want of nodes (EXIT_WANTS_NODES: a Slurm job requeues itself on it)."""
    if status is JobStatus.SUCCEEDED:
        return 0
    if status is JobStatus.STOPPED and cause is not None:
        return cause.exit_code
    return 1
