"""When the controller's loop passes over its checks and reads its connections (the pacer), and
the window in which agents and launchers are (re-)adopted.

    while something is under way:  a pass every `tick_s` (TICK_S, or PASS_PER_POD_S a pod)
    while the job trains steady:    a pass at the next deadline, IDLE_PASS_S at most
    hurry():                        the next step passes at once (a message asked for it)

Pure state and arithmetic: the controller tells it the time, whether the job is steady and
when the next deadline falls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from relaunch.controller.clock import TICK_S

__all__ = ["IDLE_PASS_S", "PASS_PER_POD_S", "READ_EVERY_S", "Adoption", "Pacer"]

READ_EVERY_S: Final = 0.02
"""While something is under way (a start, a recovery, a planned fault), the controller reads its
connections at most this often: under a steady stream of messages (heartbeats, progress) one
read takes several, at the cost of that much latency at most. While the job trains undisturbed
it reads them when a pass is due (IDLE_PASS_S at most) and at once when a peer rings its
doorbell (a message that needs a decision: an exit, a fault, a hello, a stop done;
protocol.wire), connects or closes its connection; where the doorbell cannot listen (its UDP
port is taken), at most every TICK_S."""
IDLE_PASS_S: Final = 0.25
"""While the job trains undisturbed, a pass runs when a message asks for one (`hurry`), when a
deadline falls due (a node's heartbeat timeout, a rank's hang window: `Controller.next_due`),
and at least this often (requests through the store: a stop, faults added, a cordon)."""
PASS_PER_POD_S: Final = 25e-6
"""While something is under way, passes come TICK_S apart, or this much a pod when that is
longer (0.1 s at 4,096 pods): a pass looks at every pod and node (a few microseconds each), and
so takes a bounded share of a core however large the job. What a message asks for (an exit, a
stop done, a hello) still hurries a pass at once."""


@dataclass
class Pacer:
    tick_s: float = TICK_S
    """How far apart passes come while something is under way."""
    next_pass: float = 0.0
    steady_since: float | None = None
    """Since when the job trains undisturbed (None: something is under way): passes then run
    on events and deadlines, not every tick."""
    read_at: float = 0.0
    """When (monotonic) the connections were last read."""

    @classmethod
    def for_pods(cls, pods: int) -> Pacer:
        return cls(tick_s=max(TICK_S, PASS_PER_POD_S * pods))

    def hurry(self) -> None:
        """Act on what just happened now, not at the next scheduled pass."""
        self.next_pass = 0.0

    def due(self, now: float) -> bool:
        """A pass is due; if it is, the next one is a tick later unless `passed` says better."""
        if now < self.next_pass:
            return False
        self.next_pass = now + self.tick_s
        return True

    def passed(self, now: float, steady: bool, next_due: Callable[[float], float]) -> None:
        """After a pass: hurried during it, another at once; steady, at the next deadline (the
        connections read just before); otherwise a tick after this one."""
        if self.next_pass == 0.0:
            self.steady_since = None
        elif steady:
            self.steady_since = self.steady_since or now
            self.next_pass = max(now + READ_EVERY_S, min(now + IDLE_PASS_S, next_due(now)))
        else:
            self.steady_since = None

    def read_gap(self) -> float:
        """How long reads are gathered into one: while steady, a tick (where no doorbell rings)."""
        return READ_EVERY_S if self.steady_since is None else TICK_S


@dataclass
class Adoption:
    """A start's or a resume's window for agents and launchers to (re)connect."""

    until: float = 0.0
    """Until then, agents and launchers are being (re-)adopted: no node is declared lost."""
    resuming: bool = False
    """A resume's adoption window is open (see checks.adoption)."""
    away_s: float = 0.0
    """How long the controller was away before this resume."""
