"""`relaunch submit` and `stop`, and the hidden `relaunch runner` that runs queued jobs."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from relaunch import runner, service
from relaunch.cli.common import (
    EXIT_INVALID,
    ProjectOption,
    ServerOption,
    StateDirOption,
    TokenOption,
    app,
    client_for,
    fail_input,
    job_or_exit,
    open_store,
    out,
    remote,
    say_error,
    state_dir_of,
)
from relaunch.errors import InputError, StateDirBusy
from relaunch.files import read_document
from relaunch.protocol.layout import StateDir
from relaunch.store import Store


@app.command()
def submit(
    job_file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")],
    faults_file: Annotated[
        Path | None, typer.Option("--faults", help="Fault plan to inject.")
    ] = None,
    cluster_file: Annotated[
        Path | None, typer.Option("--cluster", help="Cluster file (local mode only).")
    ] = None,
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    project: ProjectOption = "default",
) -> None:
    """Queue a job and return at once; a server (or a background runner) runs it."""
    try:
        raw = read_document(job_file)
        plan = service.plan_entries(
            read_document(faults_file) if faults_file else None, source=str(faults_file)
        )
        if server:
            client = client_for(server, token, state_dir, project)
            view = remote(lambda: client.submit(raw, plan))
            out.print(f"job {view['metadata']['name']} submitted (id {view['metadata']['id']})")
            return
        directory = state_dir_of(state_dir)
        store = Store(StateDir(directory).db)
        submission = service.Submission(
            raw=raw,
            source=str(job_file),
            cwd=os.getcwd(),
            cluster=read_document(cluster_file) if cluster_file else None,
            plan=plan,
            plan_source=str(faults_file),
            project=project,
        )
        job_id = service.submit(store, submission, time.time())
    except InputError as error:
        raise fail_input(error) from None
    state = runner.ensure_runner(directory)
    if state.started is not None:
        how = f"; runner started (pid {state.started})"
    elif state.foreground is not None:
        how = (
            f"; queued: a foreground `relaunch run` (pid {state.foreground}) holds {directory}, "
            "and the job starts when that run ends"
        )
    else:
        how = "; the running runner will take it"
    out.print(f"job {store.job(job_id).name} submitted (id {job_id}){how}", highlight=False)


@app.command()
def stop(
    job: Annotated[str, typer.Argument(help="Job name or id.")],
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    project: ProjectOption = "default",
) -> None:
    """Stop a job: a queued one at once, a running one after its pods' termination grace."""
    if server:
        client = client_for(server, token, state_dir, project)
        view = remote(lambda: client.stop(job))
        out.print(f"job {view['metadata']['name']}: stop requested ({view['status']['phase']})")
        return
    store = open_store(state_dir)
    row = job_or_exit(store, job)
    try:
        status = service.stop_job(store, row, "stopped with `relaunch stop`", time.time())
    except service.Ended as error:
        say_error(error)
        raise typer.Exit(EXIT_INVALID) from None
    out.print(f"job {row.name}: stop requested ({status.value})")


@app.command("runner", hidden=True)
def runner_command(state_dir: StateDirOption = None) -> None:
    """Run queued jobs of a state directory until none is left (started by submit / server)."""
    directory = state_dir_of(state_dir)
    try:
        held = runner.lock(directory, role="runner")
    except StateDirBusy:
        return  # another run or runner has it; it takes the queue
    try:
        runner.run_queue(
            directory, lambda text: print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)
        )
    finally:
        held.close()
