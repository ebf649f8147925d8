"""The embedded cluster: every node on this machine (cluster.local)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relaunch.cluster.config import parse_cluster
from relaunch.cluster.nvml import chips_problem, gpu_count
from relaunch.engines import EngineKind, Opening, Placement, Where
from relaunch.errors import InputError, Problem

if TYPE_CHECKING:
    from relaunch.cluster import Engine
    from relaunch.cluster.config import ClusterConfig
    from relaunch.spec import JobSpec

__all__ = ["EmbeddedKind"]


class EmbeddedKind(EngineKind):
    name = "embedded"
    summary = "the embedded cluster on this machine"
    serves = True

    def place(
        self, cluster_raw: Any, job: JobSpec | None, where: Where, say: Callable[[str], None]
    ) -> Placement:
        """The chips are this machine's GPUs where it has any: a cluster of more chips than it
        has is refused before anything starts (nvml.chips_problem)."""
        source = str(where.cluster_file or "the cluster")
        cluster = parse_cluster(cluster_raw, source=source)
        chips = sum(n.chips for n in cluster.nodes)
        problem = chips_problem(chips, gpu_count())
        if problem is not None:
            raise InputError("relaunch run", [Problem("chips", chips, problem)])
        return Placement(cluster_raw, None)

    def open(self, stored: Mapping[str, Any], at: Opening) -> tuple[Engine, ClusterConfig]:
        from relaunch.cluster.local import LocalCluster

        return LocalCluster(at.directory), at.cluster
