"""Where pods go: the first Ready nodes, in the cluster's order, with chips for them.

Pure: nodes come in as values, placements go out as a mapping; the store and the engine are the
caller's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["NodeCapacity", "free_nodes", "initial_placement", "move", "rebuild_slots", "slots"]


@dataclass(frozen=True)
class NodeCapacity:
    name: str
    chips: int
    schedulable: bool = True
    """Ready, neither isolated, faulty nor lost."""


def slots(nodes: Iterable[NodeCapacity], chips_per_pod: int, one_per_node: bool) -> list[str]:
    """Node names, one entry per pod that fits: one pod per node, or as many as its chips
    allow when `one_per_node` is False."""
    names: list[str] = []
    for node in nodes:
        if node.chips < chips_per_pod:
            continue
        fits = node.chips // chips_per_pod if chips_per_pod else 1
        names.extend([node.name] * (1 if one_per_node else max(1, fits)))
    return names


def initial_placement(
    nodes: Sequence[NodeCapacity], replicas: int, chips_per_pod: int
) -> list[str] | None:
    """A new job's pods, in order, on the first schedulable nodes with room; None if they do
    not all fit."""
    capacity = slots((n for n in nodes if n.schedulable), chips_per_pod, one_per_node=False)
    return capacity[:replicas] if len(capacity) >= replicas else None


def move(
    nodes: Sequence[NodeCapacity],
    pods: dict[int, str],
    moved: Iterable[int],
    isolating: Iterable[str],
    chips_per_pod: int,
) -> dict[int, str]:
    """New nodes for the `moved` pods (`pods`: every pod's node now). A move of some pods goes
    to standby nodes (no pod of the job on them, its own included), one pod per node; a
    whole-job rebuild (every pod moves) uses every schedulable node not being isolated. Pods
    that find no room are left out."""
    moving = sorted(set(moved))
    gone = set(moving)  # a set: a whole-job rebuild moves every pod
    staying = {node for idx, node in pods.items() if idx not in gone}
    isolated = set(isolating)
    candidates = [n for n in nodes if n.schedulable and n.name not in isolated]
    if staying:
        used = set(pods.values())
        candidates = [n for n in candidates if n.name not in used]
    free = slots(candidates, chips_per_pod, one_per_node=bool(staying))
    return {pod: free[i] for i, pod in enumerate(moving) if i < len(free)}


def free_nodes(nodes: Sequence[NodeCapacity], used: Iterable[str], chips_per_pod: int) -> list[str]:
    """Schedulable nodes with chips for a pod that no pod in `used` is on: standby nodes."""
    taken = set(used)
    return [
        n.name for n in nodes if n.schedulable and n.name not in taken and n.chips >= chips_per_pod
    ]


def rebuild_slots(nodes: Sequence[NodeCapacity], chips_per_pod: int) -> tuple[tuple[str, int], ...]:
    """Pod slots per schedulable node, for the cluster view (a whole-job rebuild's room)."""
    return tuple(
        (n.name, len(slots([n], chips_per_pod, one_per_node=False))) for n in nodes if n.schedulable
    )
