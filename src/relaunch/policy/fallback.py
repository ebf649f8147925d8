"""What happens to a recovery under way when another fault arrives, and when a fault may be
decided at all. Pure: times are arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from relaunch.faults import Fault, FaultKind
from relaunch.policy.decision import Action
from relaunch.spec import RecoverySettings

__all__ = [
    "FAILED_AT_START_S",
    "SAVE_HOLD_MAX_S",
    "SAVE_HOLD_POLL_S",
    "Consequence",
    "NewFault",
    "decide_after",
    "on_new_fault",
]

FAILED_AT_START_S: Final = 5.0
"""R-41: pods that fail within this long of an attempt's start "fail at start"."""

SAVE_HOLD_MAX_S: Final = 60.0
"""R-37's hold: a fault found while ranks that live on save a checkpoint waits for the save to end at most the job's hang window, and never longer than this."""
SAVE_HOLD_POLL_S: Final = 0.2
"""How soon a held decision looks again whether the save has ended."""


class Consequence(StrEnum):
    FALL_BACK = "fall-back"
    """The recovery under way did not work: decide its fault again, one level down."""
    DECIDE_NEW = "decide-new"
    """The recovery under way is over (failed); decide the new fault on its own."""
    ALONGSIDE = "alongside"
    """The new fault is only recorded (the policy ignores it: a node no pod uses, a link fault
    of 20 s or less, a warning): the recovery under way goes on, untouched."""


@dataclass(frozen=True)
class NewFault:
    consequence: Consequence
    fault_to_decide: Fault
    tried: frozenset[Action]


def on_new_fault(
    active: Action,
    active_fault: Fault,
    active_tried: frozenset[Action],
    new: Fault,
    new_action: Action | None = None,
) -> NewFault:
    """A new fault that the policy would act on ends the recovery under way as failed: it did
    not keep the job running. One it only records (`new_action`, what the policy decides for it
    alone, is IGNORE) leaves that recovery alone: a node no pod uses, lost while the job is
    rebuilt, says nothing about the rebuild.

    An operator retry (R-29) followed by any fault it does not absorb (a rank that exited, a hang,
    a lost node: what made the collective fail) is over, and the new fault decided on its own.
    A recovery finer than job level that is followed by a process exit or a hang failed in the
    way such recoveries fail (its restarted processes crashed, or its group never re-formed):
    its own fault falls back one level (R-20, R-23, R-36's multi-layer fallback). A hang after a
    restart upon suspension is the next hang of R-24's row, decided on its own (three in a row,
    then the fourth fails the job), as any fault after a job-level rebuild is. Any other new
    fault (a node lost, a chip fault) is decided on its own too."""
    if new_action is Action.IGNORE:
        return NewFault(Consequence.ALONGSIDE, new, frozenset())
    if active is Action.OPERATOR_RETRY:
        # the collective failed because a rank died, hung or lost its node: issuing it again
        # cannot help, and the new fault is the one to recover
        return NewFault(Consequence.DECIDE_NEW, new, frozenset())
    if active is Action.HANG_RESTART and new.kind is FaultKind.HANG:
        # the job hung again after its restart upon suspension: the next link of R-24's streak,
        # as a crash after a job-level restart is R-21's, not the restart's own failure
        return NewFault(Consequence.DECIDE_NEW, new, frozenset())
    finer = not active.rebuilds_all_pods
    if finer and new.kind in (FaultKind.PROCESS_EXIT, FaultKind.HANG):
        return NewFault(Consequence.FALL_BACK, active_fault, active_tried | {active})
    return NewFault(Consequence.DECIDE_NEW, new, frozenset())


def decide_after(
    settings: RecoverySettings,
    waiting: Iterable[tuple[Fault, frozenset[Action]]],
    attempt_started_at: float,
    pods_failed: int,
    pods: int,
    now: float,
    saving: bool = False,
) -> float | None:
    """When the waiting faults may be decided: None for now, or a later time.

    R-37 ("process-level recovery is not possible while a checkpoint is being saved or the group
    is being built; a fault then goes to the next level down"): `saving` says ranks that live on
    are saving a checkpoint. A fault no level has been tried for yet, in a job with process-level
    recovery, waits for the save to end (a rank's own save never needs the peer that failed), at
    most the hang window (capped at SAVE_HOLD_MAX_S) after the fault; then R-37 sends it down. A
    node lost at the step a checkpoint is taken is then recovered at process level, not by
    rebuilding pods, or failing the job where no pod can move. A group being built is not
    waited for: with a peer gone it never completes.

    R-41 ("every pod of a job fails within a few seconds of each other at start: failed, not
    rescheduled") can only be known once every pod has failed. A job whose policy reads it
    (fault-retry-times without job-unconditional-retry) has a first exit in the start window
    decided when every pod has failed, or when the window has passed."""
    waiting = list(waiting)
    if saving and settings.process_level and waiting and not any(t for _, t in waiting):
        hold_ends = min(f.at for f, _ in waiting) + min(settings.hang_detect_s, SAVE_HOLD_MAX_S)
        if now < hold_ends:
            return min(hold_ends, now + SAVE_HOLD_POLL_S)
    if settings.fault_retry_times == 0 or settings.unconditional_retry:
        return None
    if not waiting or any(f.kind is not FaultKind.PROCESS_EXIT or t for f, t in waiting):
        return None
    window_ends = attempt_started_at + FAILED_AT_START_S
    if now >= window_ends or pods_failed >= pods:
        return None
    return window_ends
