"""Progress reports, phase reports and the job environment, for scripts run by relaunch."""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

from relaunch.protocol.datagrams import SdkPhase, phase_datagram, progress_datagram
from relaunch.protocol.environment import Env

__all__ = ["JobEnv", "SdkPhase", "env", "report_phase", "report_progress"]

_socket: socket.socket | None = None
_address: str | None = None


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


def report_progress(step: int) -> None:
    """Tell the launcher that training reached `step`. One datagram; a no-op outside relaunch."""
    _send(progress_datagram(_rank(), step))


def report_phase(phase: str) -> None:
    """Tell the launcher what this rank is doing (`SdkPhase`): relaunch does not attempt a
    process-level recovery while a rank saves a checkpoint or builds its group (R-37). The SDK's
    checkpoints and process-group keeper call it; a no-op outside relaunch."""
    _send(phase_datagram(_rank(), phase))


def _rank() -> int:
    try:
        return int(os.environ.get(Env.RANK, "0"))
    except ValueError:
        return 0


def _send(datagram: bytes) -> None:
    global _socket, _address
    if _address is None:
        target = os.environ.get(Env.PROGRESS_SOCKET, "")
        _address = "\0" + target[1:] if target.startswith("@") else target
    if not _address:
        return
    if _socket is None:
        _socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _socket.setblocking(False)  # a slow launcher drops a report, never stalls training
    with contextlib.suppress(OSError):
        _socket.sendto(datagram, _address)
