"""R-14, fencing: a node the controller cannot hear but that may still run must not have its pods
train beside their replacements.

- Every launcher holds a lease that the controller renews (`Lease`, every quarter of the
  cluster's `lease_s`); a launcher that hears nothing for the lease stops its processes (SIGTERM,
  SIGKILL after the job's grace bounded by the lease) and exits, as an abandoned pod does.
- The replacements of a *silent* node's pods (no heartbeat: it may be cut off, not dead) start
  only once the silent node's pods have surely stopped: the fault's time (its last heartbeat, or
  the injection of the partition that silenced it), one heartbeat interval (the cut may have come
  just after it), the lease and the stop's grace, and a margin. A node the engine reports dead
  (its agent exited, `node-down`) is replaced at once.
- A checkpoint written by an old generation of a moved pod is refused (`fence.json`, the SDK's
  `check_fence`): whatever a fenced process still does never reaches storage.

The hold is derived from the recovery under way (its fault is stored with its record), so a
resumed controller holds the same replacements for the same time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from relaunch.faults import Fault, FaultKind
from relaunch.protocol.messages import Lease

if TYPE_CHECKING:
    from relaunch.controller.core import Controller

__all__ = ["FENCE_MARGIN_S", "SILENT_NODE", "LeaseKeeper", "replacements_wait_until"]

SILENT_NODE: Final = "silent"
"""How a node-lost fault's detail begins when the node fell silent rather than died."""
FENCE_MARGIN_S: Final = 1.0
"""Beyond the lease and the grace: a launcher's own loop, and the kill, take a moment."""


def replacements_wait_until(
    fault: Fault, heartbeat_interval_s: float, lease_s: float, termination_grace_s: float
) -> float | None:
    """When the replacements of the pods of `fault`'s node may start (None: at once)."""
    if fault.kind is not FaultKind.NODE_LOST or not fault.detail.startswith(SILENT_NODE):
        return None
    grace = min(termination_grace_s, lease_s)
    return fault.at + heartbeat_interval_s + lease_s + grace + FENCE_MARGIN_S


class LeaseKeeper:
    """Renews every launcher's lease, a quarter lease apart."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.renewed_at = 0.0

    def next_renewal(self) -> float:
        return self.renewed_at + self.c.cluster.lease_s / 4

    def renew(self, now: float) -> None:
        if now < self.next_renewal():
            return
        self.renewed_at = now
        c = self.c
        links = [link for p in c.pods.values() for link in (p.link, p.leaving) if link is not None]
        links += list(c.reconciler.standby.values())
        for link in links:
            if not link.peer.closed:
                link.peer.send(Lease())

    def hold_until(self) -> float | None:
        """Until when new launchers wait: the recovery under way replaces a silent node's pods."""
        c = self.c
        active = c.recoveries.active
        if active is None:
            return None
        return replacements_wait_until(
            active.fault,
            c.cluster.heartbeat_interval_s,
            c.cluster.lease_s,
            c.recovery.termination_grace_s,
        )
