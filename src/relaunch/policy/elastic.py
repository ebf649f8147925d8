"""R-33's scale-out: which parked pods go back into the group, and where (pure).

A scale-in parks whole replicas when no standby node can take them; once nodes that can (Ready,
schedulable, chips for a pod, no pod of the job on them, an agent alive) are there again, the
parked pods go back, in order, one per node, and their ranks join the running group. The
controller carries the decision out (controller.membership): new containers for those pods,
their counters as for any rescheduled container, a membership with them as joiners.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relaunch.policy.decision import Counters, PodChange

__all__ = ["ScaleOut", "scale_out"]


@dataclass(frozen=True)
class ScaleOut:
    """Parked pods that go back: (pod, node, counters) each, in pod order."""

    back: tuple[tuple[int, str, Counters], ...]

    @property
    def pods(self) -> tuple[int, ...]:
        return tuple(pod for pod, _, _ in self.back)


def scale_out(
    parked: Iterable[int],
    free_nodes: Sequence[str],
    counters: Sequence[Counters],
    recovering: bool,
) -> ScaleOut | None:
    """The scale-out to make now, or None: nothing parked, no node for one, or a recovery under
    way (it changes the group itself; the pods wait for it to end). `counters`: every pod's,
    by index."""
    waiting = sorted(set(parked))
    if not waiting or not free_nodes or recovering:
        return None
    back = tuple(
        (pod, node, PodChange.RESCHEDULED.counted(counters[pod]))
        for pod, node in zip(waiting, free_nodes, strict=False)
    )
    return ScaleOut(back)
