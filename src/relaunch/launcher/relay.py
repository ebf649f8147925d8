"""The training SDK's reports, relayed to the controller: each rank's steps, its phases (a
checkpoint save, its group being built) and the collectives that failed on their transport.

The SDK sends datagrams (protocol.datagrams) to two sockets in the abstract namespace, named
after the pod's launcher: routine steps to one, read every progress interval with the newest
step of each rank kept; what cannot wait to the other, which wakes the launcher: a rank's first
step (it proves a restart worked), its phases (whether a rank is saving decides which recovery
can run, R-37) and a collective that failed (R-29, sent at once).

    relay = ProgressRelay(name, interval_s, send)
    urgent = relay.drain(workers, attempt)   # what arrived; True if it is to go now
    relay.flush(workers, force=urgent)       # one ProgressBatch per interval at most
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping

from relaunch.launcher.processes import Worker
from relaunch.protocol.datagrams import (
    CollectiveFailure,
    CorruptionReport,
    Restore,
    parse_datagram,
)
from relaunch.protocol.environment import Env
from relaunch.protocol.messages import (
    CollectiveFailed,
    CorruptionFound,
    Message,
    Progress,
    ProgressBatch,
    RankPhase,
    Restored,
)

__all__ = ["ProgressRelay"]

Send = Callable[..., None]
"""ControllerLink.send: (message, *, urgent=None)."""


class ProgressRelay:
    def __init__(self, name: str, interval_s: float, send: Send) -> None:
        self.name = name
        self.interval_s = interval_s
        self.send = send
        self.progress = _socket(name)
        self.urgent = _socket(name + "-urgent")
        self.lock = threading.Lock()
        self.latest: dict[int, Progress] = {}
        """The newest step of each rank since the last batch."""
        self.phases: list[RankPhase] = []
        self.sent_at = 0.0
        self.read_at = 0.0

    def environment(self) -> dict[str, str]:
        """What the SDK in each rank needs to reach the relay."""
        return {
            Env.PROGRESS_SOCKET: "@" + self.name,
            Env.URGENT_SOCKET: "@" + self.name + "-urgent",
            Env.PROGRESS_EVERY: str(self.interval_s),
        }

    def due(self) -> float:
        return self.read_at + self.interval_s

    def drain(self, workers: Mapping[int, Worker], attempt: int) -> bool:
        """Every datagram that arrived, kept for the next batch; True if one is to go at once."""
        urgent = False
        for sock in (self.urgent, self.progress):
            while True:
                try:
                    data = sock.recv(256)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    return urgent
                urgent = self.received(data, workers, attempt) or urgent
        self.read_at = time.time()
        return urgent

    def received(self, data: bytes, workers: Mapping[int, Worker], attempt: int) -> bool:
        """One datagram, kept for the next progress message; True if it is to go at once."""
        parsed = parse_datagram(data)
        if parsed is None:
            return False
        rank, value, reported_at = parsed
        worker = workers.get(rank)
        attempt = worker.attempt if worker else attempt
        now = time.time()
        if isinstance(value, CollectiveFailure):  # to the controller at once
            failed = CollectiveFailed(
                rank, attempt, value.step, value.collective, value.generation, value.why, now
            )
            self.send(failed, urgent=True)
            return False
        if isinstance(value, CorruptionReport):  # to the controller at once
            step, clean, culprits, seen = value
            found = CorruptionFound(rank, attempt, step, clean, culprits, seen, now)
            self.send(found, urgent=True)
            return False
        if isinstance(value, Restore):  # for the job's record: which tier served the restore
            self.send(Restored(rank, attempt, value.step, value.tier, value.holder, now))
            return False
        with self.lock:
            if isinstance(value, str):
                self.phases.append(RankPhase(rank, attempt, value, now))
                return True
            kept = self.latest.get(rank)
            at = reported_at or now
            if kept is None or kept.at <= at:  # an older step read after a newer one stays out:
                # the urgent socket is read first, and a phase sends the step it is about there
                self.latest[rank] = Progress(rank, value, attempt, at)
            if worker is None:
                return False
            first = not worker.stepped
            worker.stepped = worker.alive_since_sample = True
            return first

    def flush(
        self, workers: Mapping[int, Worker], force: bool = False, urgent: bool | None = None
    ) -> None:
        """The newest report of each rank in one message, at most every interval: a loop that
        reports thousands of steps a second costs the controller one message per pod per
        interval (up to a second, see commands.launch_plan). `force`: now, due or not; the
        message rings the controller's doorbell if `urgent` (by default: if forced)."""
        now = time.time()
        with self.lock:
            if not (self.latest or self.phases) or (
                not force and now - self.sent_at < self.interval_s
            ):
                return
            reports, self.latest = tuple(self.latest.values()), {}
            phases, self.phases = tuple(self.phases), []
            self.sent_at = now
        busy = {w.rank: (w.busy, w.samples) for w in workers.values() if w.samples}
        message: Message = ProgressBatch(reports, phases, busy)
        self.send(message, urgent=force if urgent is None else urgent)  # a first step, a phase


def _socket(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.setblocking(False)
    return sock
