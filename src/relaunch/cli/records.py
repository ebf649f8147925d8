"""`relaunch jobs`, `describe` and `logs`: what happened to the jobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from relaunch.cli.common import (
    EXIT_INVALID,
    ProjectOption,
    ServerOption,
    StateDirOption,
    TokenOption,
    app,
    client_for,
    err,
    job_or_exit,
    open_store,
    out,
    remote,
    visible,
)
from relaunch.cli.summary import print_summary
from relaunch.report import build_report
from relaunch.spec import parse_job


@app.command()
def jobs(
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    project: ProjectOption = "default",
) -> None:
    """List jobs with their status."""
    if server:
        client = client_for(server, token, state_dir, project)
        rows = [
            (
                v["metadata"]["id"],
                v["metadata"]["name"],
                v["status"]["phase"],
                str(v["status"]["attempt"]),
                str(v["status"]["recoveries"]),
                v["status"]["reason"],
            )
            for v in reversed(remote(client.jobs))
        ]
    else:
        store = open_store(state_dir)
        rows = [
            (
                str(j.id),
                j.name,
                j.status.value,
                str(j.attempt),
                str(len(store.records(j.id))),
                j.reason,
            )
            for j in store.jobs()
        ]
    view = Table(show_edge=False)
    for column in ("id", "job", "status", "attempt", "recoveries", "reason"):
        view.add_column(column)
    for row in rows:
        view.add_row(*row)
    out.print(view)


@app.command()
def describe(
    job: Annotated[str, typer.Argument(help="Job name or id.")],
    output: Annotated[str, typer.Option("-o", "--output", help="table or json")] = "table",
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    project: ProjectOption = "default",
) -> None:
    """A job's fault-recovery details: every fault, what relaunch did, and how long it took."""
    if server:
        client = client_for(server, token, state_dir, project)
        from relaunch.api.client import summary_from_view

        summary = summary_from_view(remote(lambda: client.job(job)))
    else:
        store = open_store(state_dir)
        summary = build_report(store, job_or_exit(store, job).id)
    if output == "json":
        out.print_json(json.dumps(summary))
        return
    print_summary(summary)


@app.command()
def logs(
    job: Annotated[str, typer.Argument(help="Job name or id.")],
    pod: Annotated[int, typer.Option("--pod", help="Pod index.")] = 0,
    rank: Annotated[
        int | None, typer.Option("--rank", help="Global rank (default: the pod's first).")
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="The bytes as the rank wrote them, escapes included.")
    ] = False,
    state_dir: StateDirOption = None,
) -> None:
    """Print one rank's log (the pod's current container). Control characters (a rank's
    escape sequences) are shown as \\xNN and bytes that are not UTF-8 as U+FFFD, unless --raw."""
    store = open_store(state_dir)
    row = job_or_exit(store, job)
    pods = {p.idx: p for p in store.pods(row.id)}
    if pod not in pods:
        err.print(
            f"[bold red]error:[/] job {row.name} has pods 0..{len(pods) - 1}", highlight=False
        )
        raise typer.Exit(EXIT_INVALID)
    spec = parse_job(row.spec["raw"])
    rank = pod * spec.procs_per_pod if rank is None else rank
    path = Path(pods[pod].workdir) / "logs" / f"rank-{rank}.log"
    if not path.exists():
        err.print(
            f"[bold red]error:[/] no log for rank {rank} of pod {pod} ({path})", highlight=False
        )
        raise typer.Exit(EXIT_INVALID)
    data = path.read_bytes()
    if raw:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    sys.stdout.write(visible(data.decode("utf-8", "replace")))
