"""A pod as the controller sees it: its desired state (the store's row) and its container's phase.

    PodPhase, one pod's container:

      PLACED ──launcher started──> LAUNCHING ──hello──> RUNNING ──stop──> STOPPING
        ^                              │                   ^  <──stopped──────┘
        │                  no hello in LAUNCH_RETRY_S:     │
        │                  started again                   │ hello (it reconnected)
        │                                                  │
        │                              RUNNING/STOPPING ──connection closed──> LOST
        │                                                  LOST ──grace──> a fault ("launcher
        │                                                  died"), then PLACED
        │
        └── a new generation (a rescheduling changed the row): the old launcher is told to
            shut down and torn down (`leaving`); the new one waits until it is gone or the
            teardown limit has passed.

      PARKED: left out of the job by an elastic scale-in, until a scale-out places it again.

A pod on a node that is lost is not waited for: its node may never answer (hung or cut off).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from relaunch.controller.peers import LauncherLink
from relaunch.store import PodRow

__all__ = ["LAUNCH_RETRY_S", "Pod", "PodPhase"]

LAUNCH_RETRY_S: Final = 30.0
"""A launcher asked for that has not said hello after this long is asked for again."""


class PodPhase(StrEnum):
    PLACED = "placed"
    LAUNCHING = "launching"
    RUNNING = "running"
    STOPPING = "stopping"
    LOST = "lost"
    PARKED = "parked"


@dataclass
class Pod:
    row: PodRow
    phase: PodPhase = PodPhase.PLACED
    since: float = 0.0
    """When the phase began."""
    link: LauncherLink | None = None
    """The current generation's launcher (RUNNING, STOPPING)."""
    leaving: LauncherLink | None = None
    """The previous generation's launcher, being torn down."""
    leaving_since: float = 0.0
    launched_generation: int = 0
    """The generation a launcher was last asked for."""
    lost_generation: int = 0
    """The generation whose launcher's connection closed (LOST)."""

    @property
    def index(self) -> int:
        return self.row.idx

    @property
    def connected(self) -> bool:
        return self.phase in (PodPhase.RUNNING, PodPhase.STOPPING) and self.link is not None

    def _enter(self, phase: PodPhase, now: float) -> None:
        self.phase, self.since = phase, now

    def launching(self, now: float) -> None:
        self.launched_generation = self.row.generation
        self._enter(PodPhase.LAUNCHING, now)

    def needs_launch(self, now: float) -> bool:
        if self.phase is PodPhase.PLACED:
            return True
        return self.phase is PodPhase.LAUNCHING and (
            self.launched_generation != self.row.generation or now - self.since > LAUNCH_RETRY_S
        )

    def connect(self, link: LauncherLink, now: float) -> None:
        self.link = link
        self._enter(PodPhase.STOPPING if link.stopping else PodPhase.RUNNING, now)

    def stop_sent(self, now: float) -> None:
        assert self.link is not None
        self.link.stopping = True
        self._enter(PodPhase.STOPPING, now)

    def stopped(self, now: float) -> None:
        if self.link is not None:
            self.link.stopping = False
        if self.phase is PodPhase.STOPPING:
            self._enter(PodPhase.RUNNING, now)

    def lost(self, now: float) -> None:
        """Its launcher's connection closed."""
        self.link = None
        self.lost_generation = self.row.generation
        self._enter(PodPhase.LOST, now)

    @property
    def lost_since_moved(self) -> bool:
        """LOST, but a recovery has moved it to a new generation since: it only needs a launcher."""
        return self.phase is PodPhase.LOST and self.lost_generation != self.row.generation

    def placed(self, now: float) -> None:
        """Wants a launcher (again)."""
        self.link = None
        self._enter(PodPhase.PLACED, now)

    def retire(self, now: float, wait: bool) -> None:
        """Its launcher belongs to an older generation: torn down (waited for, unless `wait` is
        False, as for a lost node); the current generation wants a launcher."""
        if self.link is not None and wait:
            self.leaving, self.leaving_since = self.link, now
        self.placed(now)

    def park(self, now: float) -> None:
        if self.link is not None:
            self.leaving, self.leaving_since = self.link, now
        self.link = None
        self._enter(PodPhase.PARKED, now)

    def teardown_pending(self, now: float, limit: float) -> bool:
        """The previous generation is still being torn down (at most `limit` seconds)."""
        if self.leaving is None:
            return False
        if self.leaving.peer.closed or now - self.leaving_since >= limit:
            self.leaving = None
            return False
        return True
