"""Which engine runs a job: the embedded cluster, Ray (an address, or a local trial cluster), or
the Slurm allocation it runs in."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from relaunch.cli.common import EXIT_INVALID, err, out
from relaunch.cluster.config import parse_cluster
from relaunch.cluster.nvml import chips_problem, gpu_count
from relaunch.errors import EngineError, InputError, Problem

__all__ = [
    "SimulateChipsOption",
    "agents_engine",
    "check_chips",
    "engine_name",
    "ray_cluster",
    "ray_module",
    "slurm_cluster",
    "stop_trial",
]

SimulateChipsOption = Annotated[
    bool,
    typer.Option(
        "--simulate-chips",
        help="Simulated chips on the embedded cluster even where this machine has NVIDIA GPUs "
        "(no pod is given a GPU). Without it, the chips are the machine's GPUs where it has "
        "any, and a cluster of more chips than GPUs is refused.",
    ),
]


def engine_name(given: str) -> str:
    if given not in ("embedded", "ray", "slurm", "agents"):
        err.print(
            f"[bold red]error:[/] --engine {given}: choose embedded, ray, slurm or agents",
            highlight=False,
        )
        raise typer.Exit(EXIT_INVALID)
    return given


def agents_engine(address: str | None) -> dict[str, Any]:
    """The stored settings of `--engine agents --address HOST:PORT`: where the controller
    listens for the agents an operator started (`relaunch agent --controller HOST:PORT`)."""
    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(
            "relaunch run",
            [Problem("--address", address, "HOST:PORT the agents were given (--engine agents)")],
        )
    return {"kind": "agents", "host": host.strip("[]"), "port": int(port)}


def slurm_cluster(cluster_raw: Any, chips_per_pod: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's nodes in the Slurm allocation this runs in: every allocated node, in Slurm's
    order (the job's pods take the first, the rest are its standby nodes). A pod is a node's
    share of the job, as torchrun's `--nnodes` counts nodes: each node holds the chips of one
    pod (`chips_per_pod`), so that no two pods share a node (the cluster settings' chips per
    node are not read: on an 8-GPU node, `--nproc-per-node 4` is 4 GPUs of one pod, as under
    torchrun). Returns the cluster settings and the engine's stored settings."""
    from relaunch.cluster.slurm import Allocation

    allocation = Allocation.from_environment()
    parse_cluster(cluster_raw, source="cluster settings")  # its timings, checked
    settings = dict(cluster_raw) if isinstance(cluster_raw, dict) else {}
    settings["nodes"] = [{"name": name, "chips": chips_per_pod} for name in allocation.nodes]
    settings.pop("chips_per_node", None)
    out.print(
        f"[bold cyan]\\[relaunch][/] Slurm job {allocation.job_id}: {len(allocation.nodes)} "
        f"node(s) ({', '.join(allocation.nodes)}), the controller on {allocation.batch_host}",
        highlight=False,
    )
    return settings, {"kind": "slurm", "job_id": allocation.job_id}


def ray_module() -> Any:
    try:
        from relaunch.cluster import ray as ray_engine
    except ImportError:
        err.print(
            "[bold red]error:[/] --engine ray needs Ray: pip install 'relaunch[ray]'",
            highlight=False,
        )
        raise typer.Exit(EXIT_INVALID) from None
    return ray_engine


def ray_cluster(
    cluster_raw: Any, address: str | None, select: str | None
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The job's nodes on Ray: the cluster at `address`, or a local trial cluster shaped by the
    cluster file (started here, removed when the run ends). Returns the cluster settings with the
    Ray nodes as nodes, the engine's stored settings, and the trial cluster (or None)."""
    ray_engine = ray_module()
    shape = parse_cluster(cluster_raw, source="cluster settings")
    trial = None
    if address is None:
        trial = ray_engine.TrialCluster(shape.nodes)
        out.print(
            f"[bold cyan]\\[relaunch][/] starting a local Ray cluster: a head and "
            f"{len(shape.nodes)} node(s) ({trial.log})",
            highlight=False,
        )
        address = trial.start(
            progress=lambda up, total: out.print(
                f"[bold cyan]\\[relaunch][/] Ray node {up} of {total} joined", highlight=False
            )
        )
    ray_engine.connect(address)
    found = ray_engine.discover(select)
    if not found:
        stop_trial(trial)
        raise EngineError(
            f"the Ray cluster at {address} has no live node"
            + (f" carrying {select!r}" if select else "")
            + "; see `relaunch nodes --engine ray --address ...`"
        )
    settings = dict(cluster_raw) if isinstance(cluster_raw, dict) else {}
    settings["nodes"] = [{"name": n.name, "chips": n.chips} for n in found]
    settings.pop("chips_per_node", None)
    return settings, {"kind": "ray", "address": address, "select": select}, trial


def stop_trial(trial: Any) -> None:
    if trial is not None:
        trial.stop()


def check_chips(cluster_raw: Any, cluster_file: Path | None) -> None:
    """On the embedded cluster the chips are this machine's GPUs where it has any: a cluster of
    more chips than it has is refused before anything starts (nvml.chips_problem)."""
    cluster = parse_cluster(cluster_raw, source=str(cluster_file or "the cluster"))
    problem = chips_problem(sum(n.chips for n in cluster.nodes), gpu_count())
    if problem is not None:
        raise InputError(
            "relaunch run",
            [Problem("chips", sum(n.chips for n in cluster.nodes), problem)],
        )
