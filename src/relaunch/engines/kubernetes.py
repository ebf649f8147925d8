"""A Kubernetes cluster: each pod a Pod, on the nodes whose relaunch agents register them
(cluster.kubernetes; the `kubernetes` extra)."""

from __future__ import annotations

import os
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

__all__ = ["KubernetesKind"]


def _module() -> Any:
    try:
        from relaunch.cluster.kubernetes import engine
    except ImportError:
        raise EngineError(
            "--engine kubernetes needs its client: pip install 'relaunch[kubernetes]'"
        ) from None
    return engine


def _kubeconfig(where: Where) -> str | None:
    given = where.kubeconfig or os.environ.get("KUBECONFIG")
    return str(given) if given else None


class KubernetesKind(EngineKind):
    name = "kubernetes"
    summary = "a Kubernetes cluster (--kubeconfig, --namespace)"
    takes_address = True

    def _nodes(self, where: Where) -> list[Any]:
        engine = _module()
        from kubernetes import client

        try:
            core = client.CoreV1Api(engine.api_client(_kubeconfig(where)))
            return list(core.list_node(label_selector="relaunch.io/node").items)
        except Exception as error:  # the client's errors: no cluster, refused, bad file
            raise EngineError(f"the Kubernetes cluster cannot be read: {error}") from None

    def place(
        self, cluster_raw: Any, job: JobSpec | None, where: Where, say: Callable[[str], None]
    ) -> Placement:
        """The job's nodes: every Node a relaunch agent registered, Ready now, in name order
        (the job's pods take the first, the rest are its standby nodes). As on Slurm, a pod is
        a node's share of the job: each node holds one pod's chips."""
        engine = _module()
        parse_cluster(cluster_raw, source="cluster settings")  # its timings, checked
        ready = sorted(n.metadata.name for n in self._nodes(where) if engine.node_seen(n) is None)
        if not ready:
            raise EngineError("the Kubernetes cluster has no Ready node of relaunch's agents")
        chips = job.chips_per_pod if job is not None else 1
        settings = dict(cluster_raw) if isinstance(cluster_raw, dict) else {}
        settings["nodes"] = [{"name": name, "chips": chips} for name in ready]
        settings.pop("chips_per_node", None)
        namespace = where.namespace or "default"
        say(f"Kubernetes: {len(ready)} Ready node(s) ({', '.join(ready)}), namespace {namespace}")
        stored = {"kind": self.name, "kubeconfig": _kubeconfig(where), "namespace": namespace,
                  "address": where.address or "127.0.0.1"}  # fmt: skip
        return Placement(settings, stored)

    def open(self, stored: Mapping[str, Any], at: Opening) -> tuple[Engine, ClusterConfig]:
        engine = _module()
        cluster = engine.KubernetesCluster(
            at.directory, stored.get("kubeconfig"), str(stored["namespace"]), str(stored["address"])
        )
        return cluster, at.cluster

    def nodes(self, where: Where, known: Mapping[str, NodeRow]) -> NodesTable:
        engine = _module()
        table = NodesTable(("node", "kubernetes", "taints", "relaunch", "reason"))
        for node in sorted(self._nodes(where), key=lambda n: n.metadata.name):
            row = known.get(node.metadata.name)
            taints = ", ".join(
                f"{t.key}={t.value or ''}:{t.effect}" for t in node.spec.taints or []
            )
            table.rows.append(
                (
                    node.metadata.name,
                    engine.node_seen(node) or "Ready",
                    taints or "-",
                    row.state.value if row else "-",
                    row.reason if row else "not used by relaunch yet",
                )
            )
        return table
