"""The recovery under way: what it is, what it replaces, and the heal it may wait for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from relaunch.faults import Fault
from relaunch.policy import Action

__all__ = ["HEAL_TIMEOUT_S", "ActiveRecovery", "HealRequest", "OperatorState"]

HEAL_TIMEOUT_S: Final = 5.0
"""An agent that has not answered a heal request by then has not healed its chip."""


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
