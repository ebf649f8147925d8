"""Progress reports, phase reports and the job environment, for scripts run by relaunch."""

from __future__ import annotations

import atexit
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Final

from relaunch.protocol.datagrams import (
    RestoreTier,
    SdkPhase,
    collective_failure_datagram,
    corruption_datagram,
    phase_datagram,
    progress_datagram,
    restored_datagram,
)
from relaunch.protocol.environment import Env

__all__ = [
    "JobEnv",
    "RestoreTier",
    "SdkPhase",
    "env",
    "flush_progress",
    "report_collective_failure",
    "report_corruption",
    "report_phase",
    "report_progress",
    "report_restore",
]

_socket: socket.socket | None = None
_addresses: tuple[str, str, float] | None = None
"""The routine and the urgent socket's addresses, and the report interval (from the env)."""
_sent_at: float | None = None
"""When this process last sent a step (None: it has sent none)."""
_pending: tuple[int, float] | None = None
"""A step reported within the interval and not sent yet, and when the script reported it: it
goes when the process exits, unless a phase report sends it first."""
_newest: tuple[int, float] | None = None
"""The newest step reported, and when: a phase or a collective's failure is about it, so it goes
again, urgently, before them (so the controller knows the step a checkpoint is saved at, R-37;
a routine send of it may have been dropped by a launcher's full queue)."""


@dataclass(frozen=True)
class JobEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    pod: int
    schedule_cnt: int
    proc_start_cnt: int
    attempt: int

    @property
    def rescheduled(self) -> bool:
        """This pod was scheduled again after a rescheduling (MA_SCHEDULE_CNT > 1)."""
        return self.schedule_cnt > 1

    @property
    def restarted_in_place(self) -> bool:
        """The start command already ran in this container (MA_PROC_START_CNT > 1)."""
        return self.proc_start_cnt > 1


def env() -> JobEnv:
    def number(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    return JobEnv(
        rank=number(Env.RANK, 0),
        local_rank=number(Env.LOCAL_RANK, 0),
        world_size=number(Env.WORLD_SIZE, 1),
        local_world_size=number(Env.LOCAL_WORLD_SIZE, 1),
        pod=number(Env.POD, 0),
        schedule_cnt=number(Env.SCHEDULE_CNT, 1),
        proc_start_cnt=number(Env.PROC_START_CNT, 1),
        attempt=number(Env.ATTEMPT, 1),
    )


URGENT_WAIT_S: Final = 0.5
"""How long an urgent datagram (a phase, a collective's failure, a first step) waits for room in
a launcher's full queue (the kernel keeps 10 unread datagrams a socket by default): dropped, a
save's phase let a process-level recovery run during the save (R-37). A routine step is dropped
at once: the next one says more."""


def report_progress(step: int) -> None:
    """Tell the launcher that training reached `step`. One datagram, at most every
    RELAUNCH_PROGRESS_EVERY_S (the launcher forwards no more often; the first step of the
    process goes at once: it proves a restart worked); a no-op outside relaunch."""
    global _sent_at, _pending, _newest
    now = time.monotonic()
    first = _sent_at is None
    _newest = (step, time.time())
    if not first and now - (_sent_at or 0.0) < _targets()[2]:
        _pending = _newest
        return
    _sent_at, _pending = now, None
    _send(progress_datagram(_rank(), *_newest), urgent=first)


def report_phase(phase: str) -> None:
    """Tell the launcher what this rank is doing (`SdkPhase`): relaunch does not attempt a
    process-level recovery while a rank saves a checkpoint or builds its group (R-37). The SDK's
    checkpoints and process-group keeper call it; a no-op outside relaunch. The newest step goes
    first, again if it went already: the phase is about that step."""
    _send_newest()
    _send(phase_datagram(_rank(), phase), urgent=True)


def report_collective_failure(step: int, collective: int, generation: int, why: str) -> None:
    """Tell relaunch that a collective failed on its transport (R-29): collective `collective`
    of step `step`, in generation `generation` of the group (`why`: its first line, without the
    source location gloo puts first, so that the datagram keeps the cause). The newest step
    goes first. Without operator retry the keeper says so too, as collective 0 (it
    does not count a step's collectives then): relaunch re-forms the group if a data link is
    down (R-30), else the fault that broke it is decided where it is seen."""
    _send_newest()
    line = re.sub(r"^\[[^\]]*\]\s*", "", why.strip()).split("\n", 1)[0]  # gloo's file:line
    _send(collective_failure_datagram(_rank(), step, collective, generation, line), urgent=True)


def report_restore(step: int, tier: RestoreTier, holder: str = "", rank: int | None = None) -> None:
    """Tell relaunch which tier served this rank's restore of `step` (`holder`: the node, or the
    rank, that held the bytes; none for storage): it goes in the job's record."""
    datagram = restored_datagram(_rank() if rank is None else rank, step, tier.value, holder)
    _send(datagram, urgent=True)


def report_corruption(
    step: int, clean_step: int | None, culprits: tuple[int, ...], seen: tuple[str, ...]
) -> None:
    """Tell relaunch that the replicas' parameters differ at `step` (R-45): the ranks the
    majority names, the last step they all agreed, each fingerprint seen and how often."""
    _send_newest()
    _send(corruption_datagram(_rank(), step, clean_step, culprits, seen), urgent=True)


def flush_progress() -> None:
    """Send the step held back by the report interval now. At a normal exit it goes by itself
    (atexit); a process that ends by os._exit (the keeper's exit, a dying gasp) skips atexit
    and calls this first, or its last step is never heard (a job that completed step 160
    reported 159)."""
    _flush_pending(urgent=True)


def _send_newest() -> None:
    """The newest step, urgently: held back by the interval, or sent routinely and perhaps dropped
    (a routine step is dropped at once where a starved launcher's queue is full)."""
    global _pending, _sent_at
    if _newest is None:
        return
    _pending, _sent_at = None, time.monotonic()
    _send(progress_datagram(_rank(), *_newest), urgent=True)


@atexit.register
def _flush_pending(urgent: bool = False) -> None:
    global _pending, _sent_at
    if _pending is not None:
        (step, at), _pending = _pending, None
        _sent_at = time.monotonic()
        _send(progress_datagram(_rank(), step, at), urgent=urgent)


def _rank() -> int:
    try:
        return int(os.environ.get(Env.RANK, "0"))
    except ValueError:
        return 0


def _targets() -> tuple[str, str, float]:
    """(routine address, urgent address, report interval), read from the env once."""
    global _addresses
    if _addresses is None:

        def address(name: str) -> str:
            target = os.environ.get(name, "")
            return "\0" + target[1:] if target.startswith("@") else target

        try:
            every = max(0.0, float(os.environ.get(Env.PROGRESS_EVERY, "0") or 0))
        except ValueError:
            every = 0.0
        routine = address(Env.PROGRESS_SOCKET)
        _addresses = (routine, address(Env.URGENT_SOCKET) or routine, every)
    return _addresses


def _send(datagram: bytes, urgent: bool) -> None:
    global _socket
    routine, urgent_address, _ = _targets()
    target = urgent_address if urgent else routine
    if not target:
        return
    if _socket is None:
        _socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _socket.setblocking(False)  # a slow launcher drops a routine report, never stalls training
    deadline = time.monotonic() + (URGENT_WAIT_S if urgent else 0.0)
    while True:
        try:
            _socket.sendto(datagram, target)
            return
        except BlockingIOError:  # the launcher's queue is full (a busy machine starved it)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)
        except OSError:
            return
