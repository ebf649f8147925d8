"""The TCP connections of this process's process group, found and shut down from outside the
group: gloo has no abort that unblocks a rank waiting in a collective, but every peer sees its
connections shut down at once (train.group aborts a group this way)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

__all__ = ["StepGuard", "shut_down", "tcp_sockets"]


class StepGuard:
    """Whether the keeper's loop is inside a step, behind the one lock that the step's end and
    the membership watcher's decision to abort take: an abort decided inside a step never lands
    on the group formed after it (a watcher descheduled between its look and its shutdown once
    could, on a loaded machine)."""

    def __init__(self) -> None:
        self.inside = False
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.inside = True

    def leave(self) -> None:
        """Out of the step: returns once no abort is being decided."""
        with self._lock:
            self.inside = False

    @contextlib.contextmanager
    def deciding(self) -> Iterator[bool]:
        """Held while the watcher decides and aborts; says whether the loop is inside a step."""
        with self._lock:
            yield self.inside


def shut_down(sockets: set[int]) -> None:
    """Shut each connection down (both ways): its peers' and this process's reads fail now."""
    for fd in sockets:
        with contextlib.suppress(OSError):
            duplicate = socket.socket(fileno=os.dup(fd))
            try:
                duplicate.shutdown(socket.SHUT_RDWR)
            finally:
                duplicate.close()


def tcp_sockets() -> set[int]:
    """This process's connected TCP socket descriptors (Linux; elsewhere none, and aborts fall back to
    the collective timeout)."""
    found: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if probe.type == socket.SOCK_STREAM and probe.family in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                probe.getpeername()  # connected; a listening socket raises (and must stay up)
                found.add(fd)
        except OSError:
            pass
        finally:
            probe.close()
    return found
