"""The facts about the cluster that a decision depends on, as the controller observed them."""

from __future__ import annotations

from dataclasses import dataclass

from relaunch.policy.placement import NodeCapacity

__all__ = ["ClusterView", "PodView"]


@dataclass(frozen=True)
class PodView:
    index: int
    node: str
    holds_rank0: bool = False


@dataclass(frozen=True)
class ClusterView:
    """A snapshot, taken by the controller when the fault is decided."""

    pods: tuple[PodView, ...]
    standby_nodes: tuple[str, ...] = ()
    """Ready nodes that no pod of the job uses and that are not isolated."""
    checkpoint_saving: bool = False
    """A checkpoint is being written (R-37)."""
    group_building: bool = False
    """The communication group is being built (R-37)."""
    faulty_pods: frozenset[int] = frozenset()
    """Pods with another fault not yet recovered (R-31's rank-0 rule)."""
    all_pods_failed_at_start: bool = False
    """Every pod failed within seconds of each other right after start (R-41)."""
    slots: tuple[tuple[str, int], ...] = ()
    """Pod slots per schedulable node, counting the job's own nodes as empty: what a whole-job
    rebuild can use. Empty when unknown; then a rebuild needs a standby node per displaced pod."""
    nodes: tuple[NodeCapacity, ...] = ()
    """Every node in the cluster's order, its chips and whether a pod may go there: where a
    level that rebuilds pods places them (the decision's targets). Empty when unknown."""
    chips_per_pod: int = 0

    def __post_init__(self) -> None:
        indexes = [p.index for p in self.pods]
        if indexes != list(range(len(self.pods))):
            raise ValueError(f"pods must be indexed 0..n-1 in order, got {indexes}")

    def pods_on(self, node: str) -> tuple[int, ...]:
        return tuple(p.index for p in self.pods if p.node == node)

    @property
    def rank0_pod(self) -> int | None:
        return next((p.index for p in self.pods if p.holds_rank0), None)

    def rebuild_slots(self, without: str) -> int | None:
        """Pod slots for a whole-job rebuild on every schedulable node but `without`."""
        if not self.slots:
            return None
        return sum(n for name, n in self.slots if name != without)

    def affected_pods(self, node: str | None, pod: int | None) -> tuple[int, ...]:
        """The pods a fault hits: the pod it names, else every pod on its node."""
        if pod is not None:
            return (pod,)
        if node is not None:
            return self.pods_on(node)
        return tuple(p.index for p in self.pods)
