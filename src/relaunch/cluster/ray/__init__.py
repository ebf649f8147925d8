"""Ray as the engine: the same agents and launchers as the embedded cluster, on Ray nodes.

Every node relaunch uses gets one *node host*: a detached Ray actor pinned to that node
(NodeAffinitySchedulingStrategy, not soft) that starts the node's agent and its pods' launchers as
ordinary processes, in the node's own environment, exactly as the embedded cluster starts them on
one machine. The controller stays where `relaunch run` runs and listens on an address every node
reaches; agents and launchers connect to it as they do on the embedded cluster, so every recovery
works the same way.

A node is lost when Ray marks it dead or when its agent falls silent, whichever comes first.
What bounds Ray's part is the GCS health check; :data:`HEALTH_CHECK` holds the settings relaunch
gives the clusters it starts (see docs/ray.md for the measurements).

Nodes are named by a custom resource ``relaunch_node:<name>`` (what `relaunch run --engine ray`
gives the nodes of a trial cluster; add it to `ray start --resources` on a real one), otherwise
``ray-<first 8 hex digits of the node id>``. A node's chips are its ``relaunch_chips`` resource,
otherwise its GPUs.

Requires the `ray` extra: ``pip install relaunch[ray]``.
"""

from relaunch.cluster.ray.discovery import (
    CHIPS_RESOURCE,
    HEALTH_CHECK,
    NODE_RESOURCE,
    RayNode,
    connect,
    discover,
)
from relaunch.cluster.ray.engine import RayCluster
from relaunch.cluster.ray.trial import LoopbackNamespace, TrialCluster

__all__ = [
    "CHIPS_RESOURCE",
    "HEALTH_CHECK",
    "NODE_RESOURCE",
    "LoopbackNamespace",
    "RayCluster",
    "RayNode",
    "TrialCluster",
    "connect",
    "discover",
]
