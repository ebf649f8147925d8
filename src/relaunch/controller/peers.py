"""What the controller knows of its peers: node agents, pod launchers, and each rank a launcher
runs, as observed through their messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from relaunch.protocol.datagrams import SdkPhase
from relaunch.protocol.messages import Message

__all__ = ["AgentLink", "LauncherLink", "Peer", "Rank"]


class Peer(Protocol):
    """One connected agent or launcher (a wire Connection, or a fake in unit tests)."""

    @property
    def closed(self) -> bool: ...

    def send(self, message: Message) -> bool:
        """False if the peer is gone."""
        ...


@dataclass
class Rank:
    """One process of a pod, in one attempt, as its launcher reports it."""

    attempt: int
    running: bool = True
    started_at: float = 0.0
    last_activity: float = 0.0
    """Its last sign of life: a step, a line of output, CPU time or I/O (R-25)."""
    progressed: bool = False
    """It reported a step or printed since it started (the startup allowance is over)."""
    code: int | None = None
    signal: int | None = None
    usage: tuple[float, float, int] | None = None
    """(when, CPU seconds, I/O bytes) of the last usage sample."""
    phase: str = SdkPhase.TRAINING
    """What the SDK says it is doing (R-37: saving a checkpoint, building its group)."""

    @property
    def failed(self) -> bool:
        return not self.running and bool(self.code or self.signal)


@dataclass
class LauncherLink:
    peer: Peer
    pod: int
    generation: int
    pid: int
    node: str = ""
    started_attempt: int = 0
    """The attempt this launcher was last told to start."""
    stopping: bool = False
    ranks: dict[int, Rank] = field(default_factory=dict)

    def running_older_than(self, attempt: int) -> bool:
        return any(r.running and r.attempt < attempt for r in self.ranks.values())


@dataclass
class AgentLink:
    peer: Peer
    node: str
    last_heartbeat: float
    chips_written: tuple[tuple[int, str, str], ...] = ()
    """The chip faults (chip, code, kind) last written to the store for this node."""
    written_at: float = 0.0
    """When its heartbeat was last written to the store."""
