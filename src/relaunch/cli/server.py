"""`relaunch server`: the API, the dashboard and the runner of submitted jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from relaunch import engines
from relaunch.api import TOKEN_FILE
from relaunch.cli.common import (
    EXIT_INVALID,
    AddressOption,
    RaySelectOption,
    StateDirOption,
    app,
    err,
    fail_input,
    out,
    say_error,
    state_dir_of,
)
from relaunch.cli.engines import engine_kind, say
from relaunch.cluster.config import ClusterConfig, parse_cluster
from relaunch.errors import InputError, RelaunchError
from relaunch.files import read_document
from relaunch.protocol.layout import StateDir
from relaunch.store import Store


@app.command()
def server(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8080,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="embedded, or ray (with --address); a Slurm allocation or hand-started "
            "agents take `relaunch run`.",
        ),
    ] = "embedded",
    address: AddressOption = None,
    ray_select: RaySelectOption = None,
    state_dir: StateDirOption = None,
    cluster_file: Annotated[
        Path | None, typer.Option("--cluster", help="Cluster file the submitted jobs run on.")
    ] = None,
    nodes_count: Annotated[
        int | None, typer.Option("--nodes", help="Number of nodes, instead of a cluster file.")
    ] = None,
    lock_reads: Annotated[
        bool, typer.Option("--lock-reads", help="Reads need the token too, even on loopback.")
    ] = False,
    paused: Annotated[
        bool,
        typer.Option("--paused", help="Accept jobs but start none (maintenance; API tests)."),
    ] = False,
) -> None:
    """Serve the REST API, the dashboard and /metrics, and run submitted jobs."""

    kind = engine_kind(engine)
    if not kind.serves:
        servers = " or ".join(name for name in engines.names() if engines.kind(name).serves)
        err.print(
            f"[bold red]error:[/] --engine {engine}: a server runs its jobs on --engine {servers}; "
            "a Slurm allocation or hand-started agents take `relaunch run`",
            highlight=False,
        )
        raise typer.Exit(EXIT_INVALID)
    directory = state_dir_of(state_dir)
    try:
        cluster_raw = read_document(cluster_file) if cluster_file else None
        if nodes_count is not None:
            cluster_raw = {**(cluster_raw or {}), "nodes": nodes_count}
        where = engines.Where(address, ray_select, cluster_file, serving=True)
        placed = kind.place(cluster_raw, None, where, say)
        cluster_raw, engine_spec = placed.cluster, placed.stored
        cluster = parse_cluster(cluster_raw, source=str(cluster_file or "cluster settings"))
    except InputError as error:
        raise fail_input(error) from None
    except RelaunchError as error:
        say_error(error)
        raise typer.Exit(EXIT_INVALID) from None
    announce = f"; {len(cluster.nodes)} node(s); state in {directory}"
    _start(directory, cluster, cluster_raw, engine_spec, host, port, lock_reads, paused, announce)


def _start(
    directory: Path,
    cluster: ClusterConfig,
    cluster_raw: Any,
    engine_spec: Any,
    host: str,
    port: int,
    lock_reads: bool,
    paused: bool,
    announce: str,
) -> None:
    """The cluster's nodes stored, the token made (shown once), then the server runs."""
    from relaunch.api.app import ServerSettings, load_or_create_token  # FastAPI: only here
    from relaunch.api.server import serve

    store = Store(StateDir(directory).db)
    store.ensure_nodes([(n.name, n.chips) for n in cluster.nodes])
    store.close()
    token, created = load_or_create_token(directory)
    if created:
        out.print(
            f"API token (shown this once; kept in {directory / TOKEN_FILE}, mode 0600):\n{token}",
            highlight=False,
            soft_wrap=True,
        )
    else:
        out.print(f"API token: in {directory / TOKEN_FILE}", highlight=False)
    out.print(
        f"relaunch server on http://{host}:{port}/ (API /v2, OpenAPI /openapi.json, metrics "
        f"/metrics){announce}" + ("; paused: jobs are queued, none starts" if paused else ""),
        highlight=False,
        soft_wrap=True,
    )

    def log(text: str) -> None:
        out.print(f"[bold cyan]\\[relaunch][/] {escape(text)}", highlight=False, soft_wrap=True)

    settings = ServerSettings(
        directory, token, cluster_raw, lock_reads=lock_reads, engine=engine_spec
    )
    serve(settings, host, port, paused=paused, log=log)
