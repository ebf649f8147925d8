"""The recovery under way: a persisted state machine.

    decided ──record stored (its plan with it)──> WAITING ──its level sent what it must──> RUNNING
    RUNNING ──progress proves it──> SUCCEEDED
            ──its own failure, or a new fault that ends it──> FAILED
    (dump, exit: HANDED_OVER at once, the next level runs)

The record holds the phase and everything a resumed controller needs to carry the recovery on
(`to_state`): the ranks it restarts, the step it waits past, the pods it moves or parks, the
membership generation it started from, the heal it waits for, the re-issues of a collective.
A controller killed in WAITING sends again what was not sent (each level's `begin` skips what
the observed state shows done); one killed in RUNNING waits for the same proof. Only
`recovery.RecoveryDriver` moves a recovery between phases.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Final

from relaunch.faults import Fault
from relaunch.policy import Action

__all__ = [
    "HEAL_TIMEOUT_S",
    "ActiveRecovery",
    "HealRequest",
    "OperatorState",
    "RecoveryPhase",
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
    phase: RecoveryPhase = RecoveryPhase.WAITING
    alive_since: float | None = None
    """A script that reports no steps: when a process the recovery started first showed a sign
    of life. It proves the recovery once the process lived on through the start window after
    it (R-21: a traceback printed at import is no progress). Not stored: a resumed controller
    waits for the next sign."""

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
