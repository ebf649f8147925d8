"""The Slurm allocation this runs in: each node's agent a step of the job (cluster.slurm)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relaunch.cluster.config import parse_cluster
from relaunch.engines import EngineKind, NodesTable, Opening, Placement, Where
from relaunch.store import NodeState

if TYPE_CHECKING:
    from relaunch.cluster import Engine
    from relaunch.cluster.config import ClusterConfig
    from relaunch.spec import JobSpec
    from relaunch.store import NodeRow

__all__ = ["SlurmKind"]


class SlurmKind(EngineKind):
    name = "slurm"
    summary = "the Slurm allocation this runs in"

    def place(
        self, cluster_raw: Any, job: JobSpec | None, where: Where, say: Callable[[str], None]
    ) -> Placement:
        """The job's nodes in the Slurm allocation this runs in: every allocated node, in
        Slurm's order (the job's pods take the first, the rest are its standby nodes). A pod is
        a node's share of the job, as torchrun's `--nnodes` counts nodes: each node holds the
        chips of one pod, so that no two pods share a node (the cluster settings' chips per
        node are not read: on an 8-GPU node, `--nproc-per-node 4` is 4 GPUs of one pod, as
        under torchrun)."""
        from relaunch.cluster.slurm import Allocation

        allocation = Allocation.from_environment()
        parse_cluster(cluster_raw, source="cluster settings")  # its timings, checked
        chips = job.chips_per_pod if job is not None else 1
        settings = dict(cluster_raw) if isinstance(cluster_raw, dict) else {}
        settings["nodes"] = [{"name": name, "chips": chips} for name in allocation.nodes]
        settings.pop("chips_per_node", None)
        say(
            f"Slurm job {allocation.job_id}: {len(allocation.nodes)} node(s) "
            f"({', '.join(allocation.nodes)}), the controller on {allocation.batch_host}"
        )
        return Placement(settings, {"kind": self.name, "job_id": allocation.job_id})

    def open(self, stored: Mapping[str, Any], at: Opening) -> tuple[Engine, ClusterConfig]:
        """The engine of the Slurm allocation this runs in and the job's cluster there: its
        nodes are the allocation's (a requeued job's new ones); a node of the job's that this
        allocation does not hold is lost to it. In a requeued job's allocation (the job stopped
        for want of nodes), a node relaunch had lost is one Slurm gives it again: Ready."""
        from relaunch.cluster.slurm import Allocation, SlurmCluster

        allocation = Allocation.from_environment()
        for node in at.store.nodes():
            if node.name not in allocation.nodes and node.state is not NodeState.LOST:
                reason = f"not in the allocation of Slurm job {allocation.job_id}"
                at.store.set_node_state(node.name, NodeState.LOST, reason)
            elif node.name in allocation.nodes and node.state is NodeState.LOST and at.requeued:
                at.store.set_node_state(node.name, NodeState.READY, "allocated again by Slurm")
        return SlurmCluster(at.directory, allocation), allocation.cluster(at.cluster)

    def nodes(self, where: Where, known: Mapping[str, NodeRow]) -> NodesTable:
        from relaunch.cluster.slurm import Allocation, node_states

        allocation = Allocation.from_environment()
        said = node_states(list(allocation.nodes))
        table = NodesTable(("node", "slurm", "slurm reason", "address", "relaunch", "reason"))
        for name in allocation.nodes:
            node, row = said.get(name), known.get(name)
            table.rows.append(
                (
                    name,
                    node.state if node else "unknown to Slurm",
                    (node.reason if node else "") or "-",
                    node.address if node else "-",
                    row.state.value if row else "-",
                    row.reason if row else "not used by relaunch yet",
                )
            )
        return table
