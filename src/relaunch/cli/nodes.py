"""`relaunch nodes`, `cordon` and `release`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from relaunch import engines, service
from relaunch.cli.common import (
    EXIT_INVALID,
    AddressOption,
    KubeconfigOption,
    NamespaceOption,
    RaySelectOption,
    ServerOption,
    StateDirOption,
    TokenOption,
    app,
    client_for,
    node_or_exit,
    open_store,
    out,
    remote,
    say_error,
)
from relaunch.cli.engines import engine_kind
from relaunch.errors import EngineError
from relaunch.report import node_view


def _nodes_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        out.print("no nodes yet: `relaunch run` or `relaunch server` creates the embedded cluster")
        return
    view = Table(show_edge=False)
    for column in ("node", "state", "chips", "faulty chips", "reason"):
        view.add_column(column)
    for n in rows:
        faulty = ", ".join(f"{c['chip']} ({c['code']})" for c in n["faulty_chips"]) or "-"
        view.add_row(n["name"], n["state"], str(n["chips"]), faulty, n["reason"])
    out.print(view)


@app.command()
def nodes(
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="embedded; ray: the Ray cluster's nodes; slurm: this allocation's nodes; "
            "kubernetes: the cluster's nodes (--kubeconfig).",
        ),
    ] = "embedded",
    address: AddressOption = None,
    ray_select: RaySelectOption = None,
    kubeconfig: KubeconfigOption = None,
    namespace: NamespaceOption = None,
) -> None:
    """List the nodes: state, chips, chip health, isolation (with --engine ray or slurm, the
    engine's nodes with its state of each beside relaunch's)."""
    kind = engine_kind(engine)
    try:
        known = {n.name: n for n in open_store(state_dir).nodes()} if not server else {}
        where = engines.Where(address, ray_select, kubeconfig=kubeconfig, namespace=namespace)
        table = kind.nodes(where, known)
    except EngineError as error:
        say_error(error)
        raise typer.Exit(EXIT_INVALID) from None
    if table is not None:
        view = Table(show_edge=False)
        for column in table.columns:
            view.add_column(column)
        for row in table.rows:
            view.add_row(*row)
        out.print(view)
        return
    if server:
        client = client_for(server, token, state_dir, "default")
        _nodes_table(remote(client.nodes))
        return
    _nodes_table([node_view(n) for n in open_store(state_dir).nodes()])


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def agent(
    node: Annotated[str, typer.Option("--node", help="This node's name in the job's cluster.")],
    controller: Annotated[str, typer.Option("--controller", help="The controller's HOST:PORT.")],
    state_dir: StateDirOption = None,
    chips: Annotated[int, typer.Option("--chips", help="Chips on this node.")] = 2,
    address: Annotated[
        str, typer.Option("--address", help="This node's address its peers reach.")
    ] = "",
) -> None:
    """Run a node agent here by hand: it connects to the controller, reports this node's health
    and starts the pods placed on it (what Slurm's steps run; docs/slurm.md)."""
    from relaunch.cli.common import state_dir_of
    from relaunch.cluster import agent as node_agent

    node_agent.main(
        [
            "--state-dir",
            str(state_dir_of(state_dir)),
            "--node",
            node,
            "--chips",
            str(chips),
            "--controller",
            controller,
            "--address",
            address,
            "--hosts-pods",
        ]
    )


def _node_verb(
    node: str, state_dir: Path | None, server: str | None, token: str | None, verb: str
) -> None:
    if server:
        client = client_for(server, token, state_dir, "default")
        row = remote(lambda: client.node_action(node, verb))
        out.print(f"{node}: {row['state']}")
        return
    store = open_store(state_dir)
    node_or_exit(store, node)
    change = service.cordon if verb == "cordon" else service.release
    out.print(f"{node}: {change(store, node, time.time()).state.value}")


@app.command()
def cordon(
    node: str,
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Isolate a node: no new pods are placed on it."""
    _node_verb(node, state_dir, server, token, "cordon")


@app.command()
def release(
    node: str,
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Release an isolated node back to Ready."""
    _node_verb(node, state_dir, server, token, "release")
