"""R-43: the reason MindCluster writes in a reschedule record for each affected pod, from the
fault that caused the reschedule. Pure."""

from __future__ import annotations

from enum import StrEnum

from relaunch.faults.kinds import Fault, FaultKind

__all__ = ["LAUNCHER_DIED", "RescheduleReason", "reschedule_reason"]

LAUNCHER_DIED = "launcher died"
"""A process-exit fault's detail when the pod's launcher (its container) died, not a rank."""


class RescheduleReason(StrEnum):
    POD_FAILED = "pod-failed"
    """The pod (its container) failed, or relaunch's own controller was away too long."""
    NODE_UNHEALTHY = "NodeUnhealthy"
    """The node: lost, cut off, its link down or slow."""
    CARD_UNHEALTHY = "CardUnhealthy"
    """A chip: a fault code, an on-chip memory error."""
    PROCESS_EXCEPTION = "process-exception"
    """A training process: it exited, hung, or a collective it issued failed."""


_BY_KIND = {
    FaultKind.PROCESS_EXIT: RescheduleReason.PROCESS_EXCEPTION,
    FaultKind.HANG: RescheduleReason.PROCESS_EXCEPTION,
    FaultKind.COLLECTIVE: RescheduleReason.PROCESS_EXCEPTION,
    FaultKind.CHIP: RescheduleReason.CARD_UNHEALTHY,
    FaultKind.MEMORY_UCE: RescheduleReason.CARD_UNHEALTHY,
    FaultKind.SILENT_CORRUPTION: RescheduleReason.CARD_UNHEALTHY,
    FaultKind.NODE_LOST: RescheduleReason.NODE_UNHEALTHY,
    FaultKind.NETWORK: RescheduleReason.NODE_UNHEALTHY,
    FaultKind.SLOW: RescheduleReason.NODE_UNHEALTHY,
    FaultKind.CONTROLLER_OUTAGE: RescheduleReason.POD_FAILED,
}


def reschedule_reason(fault: Fault) -> RescheduleReason:
    if fault.kind is FaultKind.PROCESS_EXIT and fault.detail == LAUNCHER_DIED:
        return RescheduleReason.POD_FAILED
    return _BY_KIND[fault.kind]
