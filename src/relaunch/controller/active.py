"""The recovery under way: a persisted state machine.

    decided ──record stored (its plan with it)──> WAITING ──its level sent what it must──> RUNNING
    RUNNING ──progress proves it──> SUCCEEDED
            ──its own failure, or a new fault that ends it──> FAILED
    (dump, exit: HANDED_OVER at once, the next level runs)

The record holds the phase and everything a resumed controller needs to carry the recovery on
(`to_state`): the ranks it restarts, the step it waits past, the pods it moves or parks, the
membership generation it started from, the heal it waits for, the re-issues of a collective.
A controller killed in WAITING sends again what was not sent (each level's `begin` skips what
the observed state shows done); one killed in RUNNING waits for the same proof.

This module is the state machine's one owner: `TRANSITIONS` is the table, `recorded` writes a
record's first phase and `move` every later one (`save` stores what changed inside a phase),
each in one store statement, and the outcome the store reports is derived from the phase
(`OUTCOMES`). `ActiveRecovery.phase` has no setter; tests/test_recovery_phases.py checks that no
other module writes a phase.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from relaunch.faults import Fault
from relaunch.policy import Action, Decision
from relaunch.states import Outcome

if TYPE_CHECKING:
    from relaunch.store import RecordRow, Store

__all__ = [
    "HEAL_TIMEOUT_S",
    "OUTCOMES",
    "TRANSITIONS",
    "ActiveRecovery",
    "HealRequest",
    "IllegalTransition",
    "OperatorState",
    "RecoveryPhase",
    "first_phase",
    "move",
    "recorded",
    "save",
]

HEAL_TIMEOUT_S: Final = 5.0
"""An agent that has not answered a heal request by then has not healed its chip."""


class RecoveryPhase(StrEnum):
    WAITING = "waiting"
    """Decided and stored; what its level sends is not all sent yet."""
    RUNNING = "running"
    """Sent; waiting for the progress that proves it."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    HANDED_OVER = "handed-over"
    """dump and exit: done at once, the next level runs."""

    @property
    def live(self) -> bool:
        """Under way: a resumed controller carries it on."""
        return self in (RecoveryPhase.WAITING, RecoveryPhase.RUNNING)


TRANSITIONS: Final[Mapping[RecoveryPhase | None, frozenset[RecoveryPhase]]] = {
    # None: not recorded yet. A final decision is done at once (ignore: succeeded, fail: failed),
    # a hand-over (dump, exit) too; any other is recorded WAITING, with its plan.
    None: frozenset(
        {
            RecoveryPhase.WAITING,
            RecoveryPhase.SUCCEEDED,
            RecoveryPhase.FAILED,
            RecoveryPhase.HANDED_OVER,
        }
    ),
    # sent what its level sends; or failed before it could (a heal nobody can answer, a newer
    # fault that outranks it)
    RecoveryPhase.WAITING: frozenset({RecoveryPhase.RUNNING, RecoveryPhase.FAILED}),
    # progress proved it (or every rank exited 0); or it failed / a newer fault ended it
    RecoveryPhase.RUNNING: frozenset({RecoveryPhase.SUCCEEDED, RecoveryPhase.FAILED}),
    RecoveryPhase.SUCCEEDED: frozenset(),
    RecoveryPhase.FAILED: frozenset(),
    RecoveryPhase.HANDED_OVER: frozenset(),
}
"""Every legal change of a recovery's phase, from the phase it is in (None: no record yet)."""

OUTCOMES: Final[Mapping[RecoveryPhase, Outcome]] = {
    RecoveryPhase.WAITING: Outcome.RUNNING,
    RecoveryPhase.RUNNING: Outcome.RUNNING,
    RecoveryPhase.SUCCEEDED: Outcome.SUCCEEDED,
    RecoveryPhase.HANDED_OVER: Outcome.SUCCEEDED,
    RecoveryPhase.FAILED: Outcome.FAILED,
}
"""The outcome a record reports in each phase (the store keeps it beside the phase, written
from it in the same statement, for the readers that ask only how it went)."""


class IllegalTransition(RuntimeError):
    """A phase change the table does not allow: a defect of the controller, never an input."""


def _check(before: RecoveryPhase | None, after: RecoveryPhase) -> None:
    if after not in TRANSITIONS[before]:
        raise IllegalTransition(
            f"a recovery cannot go from {before.value if before else 'unrecorded'} to {after.value}"
        )


@dataclass
class HealRequest:
    request: int
    node: str
    deadline: float
    ok: bool | None = None
    """None until the agent answers."""


@dataclass
class OperatorState:
    """R-29 under way: where the collectives failed, when the next re-issue may go, how many
    are left, and the one out now (its generation and when it went)."""

    step: int
    collective: int
    next_at: float
    left: int
    order: int | None = None
    """The generation of the order out now (None: none)."""
    ordered_at: float = 0.0


@dataclass
class ActiveRecovery:
    """The recovery being carried out, until progress resumes (or it fails)."""

    record_id: int
    fault: Fault
    fault_id: int
    action: Action
    tried: frozenset[Action]
    started_at: float
    ranks: tuple[int, ...] = ()
    """The ranks it replaces (process level): their progress proves it."""
    after_step: int | None = None
    """For a recovery that restarts no process (online retry): progress past this step proves it."""
    heal: HealRequest | None = None
    """In-place recovery: the chip heal it waits for before starting the processes again."""
    wait_s: float | None = None
    """R-32: how long the replacement processes have to make progress (the decision's
    wait-reschedule-timeout); past it the recovery failed and its fault goes down the ladder."""
    operator: OperatorState | None = None
    """R-29: the re-issues of a failed collective."""
    pods: tuple[int, ...] = ()
    """The pods its decision moves or parks."""
    base_generation: int = 0
    """The membership generation before it: a newer one is this recovery's, published."""
    fence_until: float | None = None
    """R-14: its new launchers start no earlier (it replaces a silent node's pods)."""
    _phase: RecoveryPhase = field(default=RecoveryPhase.WAITING, repr=False)
    alive_since: float | None = None
    """A script that reports no steps: when a process the recovery started first showed a sign
    of life. It proves the recovery once the process lived on through the start window after
    it (R-21: a traceback printed at import is no progress). Not stored: a resumed controller
    waits for the next sign."""

    @property
    def phase(self) -> RecoveryPhase:
        """Where it is: changed only by `move` (no setter)."""
        return self._phase

    @classmethod
    def resumed(cls, record: RecordRow) -> ActiveRecovery:
        """The recovery a killed controller stored under way, as it stored it."""
        phase = RecoveryPhase(record.phase)
        if not phase.live:
            raise IllegalTransition(f"record {record.id} is {phase.value}: nothing to carry on")
        active = cls(
            record.id,
            record.fault,
            record.fault_id,
            record.action,
            frozenset(record.tried),
            record.started_at,
            _phase=phase,
        )
        active.restore(record.state)
        return active

    def to_state(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "after_step": self.after_step,
            "heal": asdict(self.heal) if self.heal is not None else None,
            "wait_s": self.wait_s,
            "operator": asdict(self.operator) if self.operator is not None else None,
            "pods": list(self.pods),
            "base_generation": self.base_generation,
            "fence_until": self.fence_until,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Carry on from what a killed controller stored (`to_state`)."""
        self.ranks = tuple(state.get("ranks", ()))
        self.after_step = state.get("after_step")
        heal = state.get("heal")
        self.heal = HealRequest(**heal) if heal else None
        self.wait_s = state.get("wait_s")
        operator = state.get("operator")
        self.operator = OperatorState(**operator) if operator else None
        self.pods = tuple(state.get("pods", ()))
        self.base_generation = int(state.get("base_generation", 0))
        self.fence_until = state.get("fence_until")


def first_phase(action: Action, runs: bool) -> RecoveryPhase:
    """The phase a decision's record is stored in: WAITING for a recovery that runs (with its
    plan); one done at once as `Action.done_when_recorded` says (dump / exit: HANDED_OVER)."""
    if runs:
        return RecoveryPhase.WAITING
    if action.hands_over:
        return RecoveryPhase.HANDED_OVER
    return RecoveryPhase.SUCCEEDED if action.done_when_recorded else RecoveryPhase.FAILED


def recorded(
    store: Store,
    job_id: int,
    fault_id: int,
    decision: Decision,
    tried: Sequence[Action],
    budgets: Mapping[str, int],
    now: float,
    phase: RecoveryPhase,
    active: ActiveRecovery | None = None,
) -> int:
    """A decision's record, stored in its first phase (with the plan of the recovery under way,
    `active`, when there is one); its id. One statement (inside the caller's transaction)."""
    _check(None, phase)
    if (active is not None) != phase.live:
        raise IllegalTransition(f"a record {phase.value} {'needs' if phase.live else 'has'} a plan")
    record_id = store.add_record(
        job_id,
        fault_id,
        decision,
        tried,
        budgets,
        now,
        phase.value,
        OUTCOMES[phase],
        active.to_state() if active is not None else {},
    )
    if active is not None:
        active.record_id = record_id
    return record_id


def move(
    store: Store, active: ActiveRecovery, phase: RecoveryPhase, resumed_at: float | None = None
) -> None:
    """The recovery under way goes to `phase` (refused unless the table allows it): its phase,
    outcome, state and, once it succeeded, when progress resumed and its MTTR, in one
    statement."""
    _check(active.phase, phase)
    if resumed_at is not None and phase is not RecoveryPhase.SUCCEEDED:
        raise IllegalTransition(
            f"only a recovery that succeeded resumed progress, not {phase.value}"
        )
    store.set_recovery_phase(
        active.record_id,
        phase.value,
        OUTCOMES[phase],
        active.to_state(),
        resumed_at=resumed_at,
        fault_at=active.fault.at,
    )
    active._phase = phase


def save(store: Store, active: ActiveRecovery) -> None:
    """What changed inside its phase (an operator re-issue sent, a heal asked), stored so a
    resumed controller counts it; the phase is left as it is."""
    store.save_recovery_state(active.record_id, active.to_state())
