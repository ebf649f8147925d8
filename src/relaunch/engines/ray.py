"""A Ray cluster: a node host per node starts its agent and pods (cluster.ray; the `ray` extra)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relaunch.cluster.config import parse_cluster
from relaunch.engines import EngineKind, NodesTable, Opening, Placement, Where
from relaunch.errors import EngineError

if TYPE_CHECKING:
    from relaunch.cluster import Engine
    from relaunch.cluster.config import ClusterConfig
    from relaunch.spec import JobSpec
    from relaunch.store import NodeRow

__all__ = ["RayKind", "ray_module"]


def ray_module() -> Any:
    """relaunch.cluster.ray, or why not (Ray is an extra)."""
    try:
        from relaunch.cluster import ray as ray_engine
    except ImportError:
        raise EngineError("--engine ray needs Ray: pip install 'relaunch[ray]'") from None
    return ray_engine


class RayKind(EngineKind):
    name = "ray"
    summary = "a Ray cluster (--address, or a local trial cluster)"
    takes_address = True
    takes_select = True
    serves = True

    def place(
        self, cluster_raw: Any, job: JobSpec | None, where: Where, say: Callable[[str], None]
    ) -> Placement:
        """The job's nodes on Ray: the cluster at --address, or a local trial cluster shaped by
        the cluster settings (started here, stopped when the run ends)."""
        if where.serving and where.address is None:
            raise EngineError("a server on Ray needs --address (a running Ray cluster)")
        ray_engine = ray_module()
        shape = parse_cluster(cluster_raw, source="cluster settings")
        address, trial = where.address, None
        if address is None:
            trial = ray_engine.TrialCluster(shape.nodes)
            say(
                f"starting a local Ray cluster: a head and {len(shape.nodes)} node(s) ({trial.log})"
            )
            address = trial.start(
                progress=lambda up, total: say(f"Ray node {up} of {total} joined")
            )
        ray_engine.connect(address)
        found = ray_engine.discover(where.select)
        if not found:
            if trial is not None:
                trial.stop()
            raise EngineError(
                f"the Ray cluster at {address} has no live node"
                + (f" carrying {where.select!r}" if where.select else "")
                + "; see `relaunch nodes --engine ray --address ...`"
            )
        settings = dict(cluster_raw) if isinstance(cluster_raw, dict) else {}
        settings["nodes"] = [{"name": n.name, "chips": n.chips} for n in found]
        settings.pop("chips_per_node", None)
        stored = {"kind": self.name, "address": address, "select": where.select}
        return Placement(settings, stored, trial)

    def open(self, stored: Mapping[str, Any], at: Opening) -> tuple[Engine, ClusterConfig]:
        ray_engine = ray_module()
        engine = ray_engine.RayCluster.open(
            at.directory,
            str(stored["address"]),
            [n.name for n in at.cluster.nodes],
            select=stored.get("select"),
            remove_node=at.remove_node,
        )
        return engine, at.cluster

    def nodes(self, where: Where, known: Mapping[str, NodeRow]) -> NodesTable:
        if where.address is None:
            raise EngineError("--engine ray needs --address (the Ray cluster)")
        ray_engine = ray_module()
        ray_engine.connect(where.address)
        table = NodesTable(("node", "ray", "ray node id", "address", "chips", "relaunch", "reason"))
        for n in ray_engine.discover(where.select, include_dead=True):
            row = known.get(n.name)
            table.rows.append(
                (
                    n.name,
                    "alive" if n.alive else "dead",
                    n.node_id[:12],
                    n.address,
                    str(n.chips),
                    row.state.value if row else "-",
                    row.reason if row else "not used by relaunch yet",
                )
            )
        return table
