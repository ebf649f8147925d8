"""The fault model: kinds, the code table, classification and escalation. Pure: no I/O, no clock."""

from relaunch.faults.assessment import Assessment, Cause, assess
from relaunch.faults.codes import (
    FaultCode,
    FaultCodeTable,
    FaultTableFile,
    HandlingLevel,
    parse_fault_table,
)
from relaunch.faults.default_codes import DEFAULT_TABLE
from relaunch.faults.escalation import EscalationRules, release_due
from relaunch.faults.kinds import ErrorReport, Fault, FaultKind, Severity, normalize_code
from relaunch.faults.reasons import LAUNCHER_DIED, RescheduleReason, reschedule_reason

__all__ = [
    "DEFAULT_TABLE",
    "LAUNCHER_DIED",
    "Assessment",
    "Cause",
    "ErrorReport",
    "EscalationRules",
    "Fault",
    "FaultCode",
    "FaultCodeTable",
    "FaultKind",
    "FaultTableFile",
    "HandlingLevel",
    "RescheduleReason",
    "Severity",
    "assess",
    "normalize_code",
    "parse_fault_table",
    "release_due",
    "reschedule_reason",
]
