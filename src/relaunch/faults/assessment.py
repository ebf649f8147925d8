"""Classification: what an observed fault means for recovery (R-08 to R-13).

:func:`assess` looks a fault up in the code table and against the job's earlier faults and says
whether it is to be handled at all, whether it is the environment's fault or the software's,
whether it heals in place, whether it was caused by the user's input, and whether R-10 escalates
it. The policy decides what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from relaunch.faults.codes import FaultCode, FaultCodeTable
from relaunch.faults.escalation import (
    EscalationRules,
    escalates,
    is_network_blip,
    same_code_elsewhere,
)
from relaunch.faults.kinds import Fault, FaultKind, Severity

__all__ = ["Assessment", "Cause", "assess"]

UCE_DEFAULT_CODE = "80E01801"


class Cause(StrEnum):
    """Whose fault it is, as far as the cluster can tell."""

    NONE = "none"  # nothing to handle: record only
    ENVIRONMENT = "environment"  # hardware, node or network
    SOFTWARE = "software"  # the cluster cannot attribute it to hardware


@dataclass(frozen=True)
class Assessment:
    fault: Fault
    cause: Cause
    row: FaultCode | None
    """The code table's row for chip and memory faults."""
    self_healable: bool
    """Clears without moving the job: Minor/Major chip faults, memory errors, a link that returns."""
    user_induced: bool
    """Caused by the user's operator or data (R-11): never isolates a node."""
    escalated: bool
    """R-10 fired: the same code too often on this chip."""
    reason: str

    @property
    def handled(self) -> bool:
        return self.cause is not Cause.NONE


def assess(
    fault: Fault,
    earlier: Sequence[Fault],
    table: FaultCodeTable,
    rules: EscalationRules,
) -> Assessment:
    """Classify `fault` given the job's `earlier` faults (any order, any kinds)."""
    found = _without_code(fault, rules)
    return found if found is not None else _chip(fault, earlier, table, rules)


def _without_code(fault: Fault, rules: EscalationRules) -> Assessment | None:
    """The kinds classified by what they are, not by a fault code (None: a chip's fault)."""
    kind = fault.kind
    if kind is FaultKind.PROCESS_EXIT:
        return _plain(fault, Cause.SOFTWARE, "a rank exited with no hardware fault found")
    if kind is FaultKind.HANG:
        return _plain(fault, Cause.SOFTWARE, "no progress for the hang window")
    if kind is FaultKind.SLOW:
        return _plain(
            fault,
            Cause.ENVIRONMENT,
            "SubHealthFault: the pod runs slower than its peers and holds the job back",
        )
    if kind is FaultKind.NODE_LOST:
        return _plain(fault, Cause.ENVIRONMENT, "node heartbeat lost")
    if kind is FaultKind.CONTROLLER_OUTAGE:
        return _plain(
            fault,
            Cause.ENVIRONMENT,
            "relaunch's controller was away longer than the adopt grace: the pods ended themselves",
        )
    if kind is FaultKind.SILENT_CORRUPTION:
        if fault.node is None:
            why = "the replicas' parameters differ and no majority names a rank: rolled back"
            return _plain(fault, Cause.SOFTWARE, why)
        why = f"silent data corruption: rank {fault.rank}'s parameters differ from the majority's"
        return Assessment(fault, Cause.ENVIRONMENT, None, False, False, False, why)
    if kind is FaultKind.COLLECTIVE:
        if fault.node is None:  # no link was seen down: nothing to blame but the job
            return _plain(
                fault, Cause.SOFTWARE, "a collective failed with no link fault seen on any node"
            )
        why = f"a collective failed while the data link of {fault.node} was down"
        return Assessment(fault, Cause.ENVIRONMENT, None, True, False, False, why)
    if kind is FaultKind.NETWORK:
        if is_network_blip(fault, rules):
            return _plain(
                fault,
                Cause.NONE,
                f"link down {fault.duration_s:g} s <= {rules.network_blip_s:g} s: recorded only (R-12)",
            )
        return Assessment(fault, Cause.ENVIRONMENT, None, True, False, False, "network link down")
    return None


def _chip(
    fault: Fault, earlier: Sequence[Fault], table: FaultCodeTable, rules: EscalationRules
) -> Assessment:
    """A chip's fault (or a memory UCE), by its code in the fault table (R-09, R-10, R-13)."""
    kind = fault.kind
    code = fault.code or (UCE_DEFAULT_CODE if kind is FaultKind.MEMORY_UCE else None)
    assert code is not None  # Fault checks that chip faults carry a code
    row = table.lookup(code, fault.reported_severity)
    if row.severity is Severity.WARNING:
        why = f"{row.level.mindcluster_name}, severity Warning: recorded only"
        return Assessment(fault, Cause.NONE, row, False, row.user_induced, False, why)
    if same_code_elsewhere(fault, earlier, rules):
        why = (
            f"{code} on several chips within {rules.multi_chip_window_s:g} s: "
            "a software fault (R-13)"
        )
        return Assessment(fault, Cause.SOFTWARE, row, False, row.user_induced, False, why)
    escalated = kind is FaultKind.CHIP and escalates(fault, earlier, rules)
    why = f"{row.level.mindcluster_name}, severity {row.severity.name.capitalize()}"
    if escalated:
        why += f"; {rules.threshold} in a row on this chip within {rules.window_s:g} s (R-10)"
    return Assessment(
        fault,
        Cause.ENVIRONMENT,
        row,
        row.severity.self_healable,
        row.user_induced,
        escalated,
        why,
    )


def _plain(fault: Fault, cause: Cause, reason: str) -> Assessment:
    return Assessment(fault, cause, None, False, False, False, reason)
