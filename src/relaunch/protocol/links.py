"""The link faults a fault plan can put on a node of the embedded cluster, as the controller, the
engine and the fault's helper process name them (standard library only)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Cut", "LinkFaultKind"]


class LinkFaultKind(StrEnum):
    DOWN = "down"
    """The node's data link loses its carrier."""
    PARTITION = "partition"
    """Blackhole routes, both ways, between the node and what `Cut` says."""
    DEGRADED = "degraded"
    """The data link limited to a rate (a token bucket, both directions)."""


class Cut(StrEnum):
    """What a partition separates the node from."""

    CONTROLLER = "controller"
    """Its management link: the controller hears nothing from the node, its peers still do."""
    PEERS = "peers"
    """Its data link: its ranks cannot reach the other nodes' ranks."""
    BOTH = "both"
