"""R-14, fencing: a node the controller cannot hear but that may still run must not have its pods
train beside their replacements.

- Every launcher holds a lease that the controller renews (`Lease`, every quarter of the
  cluster's `lease_s`); a launcher that hears nothing for the lease stops its processes (SIGTERM,
  SIGKILL after the job's grace bounded by the lease) and exits, as an abandoned pod does.
- The replacements of a *silent* node's pods (no heartbeat: it may be cut off, not dead) start
  only once the silent node's pods have surely stopped. What its launchers last heard is bounded
  by what the controller last sent them: the last lease to that node (leases stop once it is lost
  or isolated), or, for a controller that sent it none (resumed), the moment this controller
  started (the one before it was gone by then); never before the fault and one heartbeat
  interval. From there, the lease, the stop's grace and a margin. The bound does not depend on
  when the cut really happened: a partition whose helper takes seconds to apply it on a busy
  machine is fenced as well as an instant one. A node the engine reports dead (its agent exited,
  `node-down`) is replaced at once.
- A checkpoint written by an old generation of a moved pod is refused (`fence.json`, the SDK's
  `check_fence`): whatever a fenced process still does never reaches storage.

The hold is part of the recovery's plan (`ActiveRecovery.fence_until`, stored with its record), so
a resumed controller holds the same replacements until the same moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from relaunch.controller.detectors import SILENT_NODE
from relaunch.faults import Fault, FaultKind
from relaunch.protocol.messages import Lease
from relaunch.states import NodeState

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext

__all__ = ["FENCE_MARGIN_S", "LeaseKeeper", "replacements_wait_until"]

FENCE_MARGIN_S: Final = 1.0
"""Beyond the lease and the grace: a launcher reads a lease a moment after it was sent, and its
own loop, and the kill, take a moment."""


def replacements_wait_until(
    fault: Fault,
    last_heard_by: float | None,
    heartbeat_interval_s: float,
    lease_s: float,
    termination_grace_s: float,
) -> float | None:
    """When the replacements of the pods of `fault`'s node may start (None: at once).
    `last_heard_by`: the latest moment its launchers can have heard the controller."""
    if fault.kind is not FaultKind.NODE_LOST or not fault.detail.startswith(SILENT_NODE):
        return None
    heard = max(fault.at + heartbeat_interval_s, last_heard_by or 0.0)
    return heard + lease_s + min(termination_grace_s, lease_s) + FENCE_MARGIN_S


class LeaseKeeper:
    """Renews the lease of every launcher on a node in use, a quarter lease apart, and knows when
    each node's launchers last got one."""

    def __init__(self, controller: ControllerContext) -> None:
        self.c = controller
        self.renewed_at = 0.0
        self.started_at = controller.clock.now()
        self.sent_to: dict[str, float] = {}
        """Node -> when a lease last went to a launcher on it."""

    def next_renewal(self) -> float:
        return self.renewed_at + self.c.cluster.lease_s / 4

    def renew(self, now: float) -> None:
        if now < self.next_renewal():
            return
        self.renewed_at = now
        c = self.c
        links = [link for p in c.pods.values() for link in (p.link, p.leaving) if link is not None]
        links += list(c.reconciler.standby.values())
        lease = Lease()  # one message for all, encoded once (protocol.wire)
        for link in links:
            node = c.node(link.node) if link.node else None
            if node is not None and node.state in (NodeState.LOST, NodeState.ISOLATED):
                continue  # fenced: its launchers stop once their lease runs out
            if not link.peer.closed and link.peer.send(lease) and link.node:
                self.sent_to[link.node] = now

    def fence_until(self, fault: Fault) -> float | None:
        """For a recovery of `fault` (decided now): until when its new launchers wait."""
        c = self.c
        node = fault.node or ""
        return replacements_wait_until(
            fault,
            self.sent_to.get(node, self.started_at),
            c.cluster.heartbeat_interval_s,
            c.cluster.lease_s,
            c.recovery.termination_grace_s,
        )

    def hold_until(self) -> float | None:
        """Until when new launchers wait: the recovery under way replaces a silent node's pods."""
        active = self.c.recoveries.active
        return active.fence_until if active is not None else None
