"""Progress reports and the job environment, for scripts run by relaunch."""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

__all__ = ["JobEnv", "env", "report_progress"]

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
        rank=number("RANK", 0),
        local_rank=number("LOCAL_RANK", 0),
        world_size=number("WORLD_SIZE", 1),
        local_world_size=number("LOCAL_WORLD_SIZE", 1),
        pod=number("RELAUNCH_POD", 0),
        schedule_cnt=number("MA_SCHEDULE_CNT", 1),
        proc_start_cnt=number("MA_PROC_START_CNT", 1),
        attempt=number("RELAUNCH_ATTEMPT", 1),
    )


def report_progress(step: int) -> None:
    """Tell the launcher that training reached `step`. One datagram; a no-op outside relaunch."""
    global _socket, _address
    if _address is None:
        target = os.environ.get("RELAUNCH_PROGRESS_SOCKET", "")
        _address = "\0" + target[1:] if target.startswith("@") else target
    if not _address:
        return
    if _socket is None:
        _socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _socket.setblocking(False)  # a slow launcher drops a report, never stalls training
    with contextlib.suppress(OSError):
        _socket.sendto(f"{os.environ.get('RANK', '0')} {int(step)}".encode(), _address)
