"""What the controller knows of its peers: node agents, pod launchers, and each rank a launcher
runs, as observed through their messages."""

from __future__ import annotations

from collections import deque
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
    phase_since: float = 0.0
    """When it said so (a save counts as progress for a while: detectors.hang_fault)."""
    stopped_at: float = 0.0
    """When its launcher last found it stopped (SIGSTOP, a debugger)."""
    save_ended_at: float = 0.0
    """When its last checkpoint save ended: its peers, waiting for it meanwhile in a
    collective, are silent from then on, not from before the save."""
    busy: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(when, busy looks, looks) as its launcher reported them, back to the start of the slow
    window: how much of it the rank was not waiting for its peers (diagnosis.subhealth)."""

    def looked(self, now: float, busy: int, looks: int, window_s: float) -> None:
        """A report of looks; only the last one at or before the window's start is kept."""
        self.busy.append((now, busy, looks))
        while len(self.busy) > 1 and self.busy[1][0] <= now - window_s:
            self.busy.popleft()

    def busy_share(self, since: float) -> tuple[float, int] | None:
        """The share of looks since `since` that found it busy, and how many looks; None if its
        reports do not reach back that far."""
        if not self.busy or self.busy[0][0] > since:
            return None
        then = next(b for b in reversed(self.busy) if b[0] <= since)
        _, busy, looks = self.busy[-1]
        seen = looks - then[2]
        return ((busy - then[1]) / seen, seen) if seen > 0 else None

    @property
    def saving(self) -> bool:
        """It said it saves a checkpoint, and was not found stopped since (a rank stopped in
        its save saves nothing: its silence is a hang's, R-25)."""
        return self.phase == SdkPhase.CHECKPOINT and self.stopped_at < self.phase_since

    @property
    def forming(self) -> bool:
        """It said it builds its group (a rendezvous: it waits for its peers to start, import
        and arrive), and was not found stopped since: its silence is part of the startup."""
        return self.phase == SdkPhase.GROUP and self.stopped_at < self.phase_since

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
    oldest: int | None = field(default=None, init=False, repr=False, compare=False)
    """The oldest attempt of a running rank, as `ranks_changed` last left it (None: none)."""
    oldest_known: bool = field(default=False, init=False, repr=False, compare=False)
    failed_collective: tuple[int, int] | None = field(default=None, init=False, compare=False)
    """The (generation, step) of the last failed collective of this pod's ranks put on record as
    a symptom (once a pod, not once a rank: dispatch._collective_failed)."""

    def ranks_changed(self) -> None:
        """A rank started or exited: the next `running_older_than` looks at the ranks again
        (the reconciler asks it of every launcher at every pass; thousands of ranks)."""
        self.oldest_known = False

    def running_older_than(self, attempt: int) -> bool:
        if not self.oldest_known:
            self.oldest = min((r.attempt for r in self.ranks.values() if r.running), default=None)
            self.oldest_known = True
        return self.oldest is not None and self.oldest < attempt


@dataclass
class AgentLink:
    peer: Peer
    node: str
    last_heartbeat: float
    peer_memory: str = ""
    """HOST:PORT of the node's peer memory (its agent's hello); "" : none."""
    chips_written: tuple[tuple[int, str, str], ...] = ()
    """The chip faults (chip, code, kind) last written to the store for this node."""
    written_at: float = 0.0
    """When its heartbeat was last written to the store."""
    link_down_since: float | None = None
    """Since when its heartbeats say the node's data link is down (None: it is up)."""
    data_rtt_ms: float | None = None
    """The round trip its probes of the neighbours took on the data link (real links only)."""
    network_waited_until: float = 0.0
    """Until when the node's ranks wait for the network: while the link is down, and after it,
    as long again as it was down (TCP resends at doubling intervals). The hang window counts
    from there."""
