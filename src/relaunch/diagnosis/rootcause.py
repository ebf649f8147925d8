"""Which failure caused the others. One stuck or crashed rank makes its peers fail at their next
collective, and their exits may reach the controller first; a lost node takes the ranks elsewhere
with it. The faults one recovery answers form a group: the first one stored (the one decided) and
its collateral. The root cause is the member that failed on its own account (its error does not
say that a peer went away) and, among those, the one that failed first by the time it happened,
not by the order the messages arrived."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from relaunch.faults import Fault, FaultKind

__all__ = ["PEER_FAILURE", "Group", "caused_by_peer", "failure_time", "is_collateral", "root_cause"]

PEER_FAILURE: Final = (
    "connection closed by peer",  # gloo
    "connection reset by peer",
    "broken pipe",
    "remote worker crash",  # gloo's hint
    "remote process exited",  # NCCL error 6
    "watchdog caught collective operation timeout",  # NCCL's watchdog
    "collective operation timeout",
    "wait timeout",
    "failed to recv, got 0 bytes",  # the c10d store's peer went away
    "connection refused",  # the rendezvous store's host went away
)
"""What collectives and the c10d store say when the failure is another rank's (lower case)."""
PEER_FAILURE_TYPES: Final = ("DistNetworkError", "DistBackendError", "DistStoreError")


@dataclass(frozen=True)
class Group:
    """A fault that was stored to be decided, and the attempt of the job it happened in."""

    fault_id: int
    first: Fault
    attempt: int


def failure_time(fault: Fault) -> float:
    """When the failure happened: when the rank wrote its error file or printed its traceback,
    if that came before its exit (a rank's teardown after an exception can take seconds). A rank
    that left no exception, only its last output, failed when it exited: that line may be old."""
    error = fault.error
    if error is not None and (error.type or error.source == "error-file"):
        return min(fault.at, error.at)
    return fault.at


def caused_by_peer(fault: Fault) -> bool:
    """The rank's own error says that it failed because a peer went away or timed out."""
    error = fault.error
    if error is None:
        return False
    if error.type.rsplit(".", 1)[-1] in PEER_FAILURE_TYPES:
        return True
    text = error.message.lower()
    return any(pattern in text for pattern in PEER_FAILURE)


def is_collateral(
    group: Group, fault: Fault, attempt: int, started_at: float, window_s: float
) -> bool:
    """A process exit belongs to `group` when it is of the same attempt, of a process that was
    running when the group's fault happened (a replacement started since fails on its own
    account) and it failed within `window_s` of that fault, before or after it."""
    if fault.kind is not FaultKind.PROCESS_EXIT or attempt != group.attempt:
        return False
    first = failure_time(group.first)
    if started_at > first:
        return False
    return abs(failure_time(fault) - first) <= window_s


def root_cause(faults: Sequence[Fault]) -> Fault:
    """The member of a group that failed on its own account first (the first stored on a tie);
    if every member blames a peer, the one that failed first."""
    if not faults:
        raise ValueError("a group has at least one fault")
    return min(faults, key=lambda f: (caused_by_peer(f), failure_time(f)))
