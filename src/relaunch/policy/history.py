"""A job's recovery history as the policy sees it: earlier faults and the recoveries they got.

Budgets used and streaks are derived from the records, never stored beside them, so that they
cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from relaunch.faults import Cause, Fault, FaultKind
from relaunch.policy.decision import Action, Budget, Counters, Decision, PodChange, Streak, Streaks

__all__ = ["JobHistory", "RecoveryRecord"]


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery carried out (or being carried out) for one fault."""

    at: float
    fault: Fault
    cause: Cause
    action: Action
    pods: tuple[int, ...] = ()
    consumes: frozenset[Budget] = frozenset()
    isolated: tuple[str, ...] = ()
    succeeded: bool | None = None
    """None while it runs; True once progress resumed; False when it did not work."""
    fault_id: int = 0
    """The stored fault's id: the records of one fault share it (0: not stored, the fault
    itself tells them apart)."""

    @property
    def fault_key(self) -> object:
        """What the records of one fault share: its stored id, or the fault itself."""
        return self.fault_id or self.fault


@dataclass(frozen=True)
class JobHistory:
    """Everything the policy needs to know about the past of one job."""

    pods: int
    faults: tuple[Fault, ...] = ()
    records: tuple[RecoveryRecord, ...] = ()
    counters: tuple[Counters, ...] = ()

    def __post_init__(self) -> None:
        if not self.counters:
            object.__setattr__(self, "counters", tuple(Counters() for _ in range(self.pods)))
        if len(self.counters) != self.pods:
            raise ValueError(f"{len(self.counters)} counters for {self.pods} pods")

    # -- changes (each returns a new history) --------------------------------------------------

    def with_fault(self, fault: Fault) -> JobHistory:
        return replace(self, faults=(*self.faults, fault))

    def with_decision(self, decision: Decision, at: float) -> JobHistory:
        """Record a decision being carried out; its counters take effect. The record reads as
        the store's does (tests/test_recovery_phases.py compares them)."""
        record = RecoveryRecord(
            at=at,
            fault=decision.assessment.fault,
            cause=decision.assessment.cause,
            action=decision.action,
            pods=decision.pods,
            consumes=decision.consumes,
            isolated=decision.isolate_nodes,
            succeeded=decision.action.done_when_recorded,
        )
        counters = decision.counters or self.counters
        return replace(self, records=(*self.records, record), counters=counters)

    def with_outcome(self, succeeded: bool) -> JobHistory:
        """Settle the last record: did the recovery work?"""
        if not self.records:
            raise ValueError("no recovery to settle")
        last = replace(self.records[-1], succeeded=succeeded)
        return replace(self, records=(*self.records[:-1], last))

    # -- derived ------------------------------------------------------------------------------

    def used(self, budget: Budget) -> int:
        """How much of a budget the records have spent."""
        if budget is Budget.FAULT_RETRY:
            return sum(1 for r in self.records if budget in r.consumes and r.succeeded is True)
        return sum(1 for r in self.records if budget in r.consumes)

    def process_restarts(self, pod: int) -> int:
        """Process restarts in the pod's current container (a rebuild starts a new count)."""
        count = 0
        for r in self.records:
            level = r.action.level
            change = level.change_of(pod in r.pods)
            if change is PodChange.RESCHEDULED:
                count = 0
            elif level.restarts_a_process and pod in r.pods:
                count += 1
        return count

    @property
    def streaks(self) -> Streaks:
        return _streaks(self.records)

    def streaks_with(self, decision: Decision) -> Streaks:
        extra = RecoveryRecord(
            0.0, decision.assessment.fault, decision.assessment.cause, decision.action
        )
        return _streaks((*self.records, extra))


def _streaks(records: tuple[RecoveryRecord, ...]) -> Streaks:
    """Trailing runs of faults (R-21, R-24): a fault is one fault however many levels it fell
    through, and counts by the level it ended at (its last record but a hand-over, dump or
    exit). A software fault that ended in a job reschedule extends the unconditional run; one
    that ended in a hang restart, the hang run. A fault only recorded (ignore), relaunch's own
    outage, and a software fault whose process-level recovery did not work and that went no
    further (a newer failure of the same broken attempt ended it, or it is the fault being
    decided) neither extend nor break a run: the job made no progress in between. Any other
    fault breaks both: a recovery that worked, or one with a node or chip at fault."""
    unconditional = hang = 0
    counting_unconditional = counting_hang = True
    for decisive in _decisive_records(records):
        if _neutral(decisive):
            continue
        streak = decisive.action.level.streak  # the levels that extend a run (policy.rungs)
        if streak is Streak.UNCONDITIONAL and decisive.cause is Cause.SOFTWARE:
            unconditional += counting_unconditional
        else:
            counting_unconditional = False
        if streak is Streak.HANG:
            hang += counting_hang
        else:
            counting_hang = False
        if not (counting_unconditional or counting_hang):
            break
    return Streaks(unconditional=unconditional, hang=hang)


def _decisive_records(records: tuple[RecoveryRecord, ...]) -> list[RecoveryRecord]:
    """Each fault's decisive record (its last one that is not a hand-over), newest fault first;
    a fault whose records are all hand-overs is left out. One pass, newest record first."""
    decisive: dict[object, RecoveryRecord | None] = {}
    for record in reversed(records):
        key = record.fault_key
        if decisive.get(key) is None:
            decisive[key] = None if record.action.hands_over else record
    return [r for r in decisive.values() if r is not None]


def _neutral(r: RecoveryRecord) -> bool:
    """A record that neither extends nor breaks a run (see _streaks)."""
    if r.action is Action.IGNORE or r.fault.kind is FaultKind.CONTROLLER_OUTAGE:
        return True
    return r.action.process_level and r.cause is Cause.SOFTWARE and r.succeeded is not True
