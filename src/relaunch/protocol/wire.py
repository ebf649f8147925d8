"""The wire between the controller and its agents and launchers: one message per line of JSON
over TCP (see protocol.messages for the messages).

The controller listens; node agents and pod launchers connect to it and say who they are. When the
controller goes away, a peer reconnects to whichever controller next writes its address into the
state directory (`controller.json`), so a controller restart loses no peer.

The doorbell: the controller also listens for UDP datagrams on its port number. A peer sends the
controller a one-byte datagram after every message that is not `Message.ROUTINE` (an exit, a
hello, a stop done, a first step, ...), so that a controller that reads its connections only a
few times a second while the job trains undisturbed still reads that message at once. The
message itself travels on the connection as every other (their order is kept); a bell that is
lost (UDP filtered between hosts) only delays it to the controller's next read.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final, TextIO

from relaunch.protocol.layout import StateDir
from relaunch.protocol.messages import Message, decode, encode_line

__all__ = ["Connection", "controller_address", "write_controller_address"]


READ_AT_MOST: Final = 8 << 20
"""Bytes one `read_ready` takes from a peer at most, so that one peer cannot hold the reader."""


_last_line: tuple[Message | None, bytes] = (None, b"")


def _line(message: Message) -> bytes:
    """The message as a line on the wire. The last one is kept: a message the controller sends
    to every launcher (a membership, a lease) is one object, encoded once however many pods."""
    global _last_line
    last, line = _last_line  # one read of the pair: another thread may replace it meanwhile
    if last is not message:
        line = encode_line(message) + b"\n"
        _last_line = (message, line)
    return line


class Connection:
    """One peer's socket: thread-safe `send`, blocking iteration over received messages."""

    def __init__(self, sock: socket.socket, doorbell: tuple[str, int] | None = None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._reader: TextIO | None = None
        """Made by the first iteration only: the controller reads with `read_ready`, and a
        reader made for each of thousands of launchers was a tenth of its connections' cost."""
        self._lock = threading.Lock()
        self._pending = b""
        self._doorbell = doorbell
        self._bell: socket.socket | None = None
        self.closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 2.0) -> Connection:
        """A peer's connection to the controller at (host, port), ringing its doorbell there."""
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        return cls(sock, doorbell=sock.getpeername()[:2])

    def local_address(self) -> str:
        """This end's address: the one the peer reaches this host by."""
        return str(self._sock.getsockname()[0])

    def send(self, message: Message, *, urgent: bool | None = None) -> bool:
        """False if the peer is gone; never raises for a closed connection. A connection to the
        controller rings its doorbell after a message that is `urgent` (by default: one that is
        not `Message.ROUTINE`)."""
        data = _line(message)
        with self._lock:
            if self.closed:
                return False
            try:
                self._sock.sendall(data)
            except OSError:
                self.closed = True
                return False
            if self._doorbell is not None and (not message.ROUTINE if urgent is None else urgent):
                self._ring(self._doorbell)
            return True

    def _ring(self, doorbell: tuple[str, int]) -> None:
        """One datagram to the controller's doorbell (held lock: one bell socket)."""
        try:
            if self._bell is None:
                family = socket.AF_INET6 if ":" in doorbell[0] else socket.AF_INET
                self._bell = socket.socket(family, socket.SOCK_DGRAM)
                self._bell.setblocking(False)
            self._bell.sendto(b"!", doorbell)
        except OSError:
            pass  # a bell that cannot ring only delays the message to the next read

    def __iter__(self) -> Iterator[Message]:
        """The messages received, until the peer goes; a line that is not a message is skipped."""
        if self._reader is None:
            self._reader = self._sock.makefile("r", encoding="utf-8", newline="\n")
        try:
            for line in self._reader:
                message = decode(line) if line.strip() else None
                if message is not None:
                    yield message
        except (OSError, ValueError):
            pass
        finally:
            self.close()

    def read_ready(self) -> list[Message] | None:
        """The messages that arrived, for a reader that waits on many connections with a
        selector (the controller) and calls this once the socket is readable: one receive, which
        does not block then. None once the peer is gone. Not to be mixed with iteration."""
        try:
            data = self._sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            return None
        # and what else arrived already, without waiting (up to READ_AT_MOST): a message larger
        # than one receive is read whole now, not a receive at each of the controller's passes
        chunks = [data]
        received = len(data)
        while received < READ_AT_MOST:
            try:
                more = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError, OSError):
                break
            if not more:
                break  # the peer closed: the next read says so
            chunks.append(more)
            received += len(more)
        *lines, self._pending = (self._pending + b"".join(chunks)).split(b"\n")
        messages = []
        for line in lines:
            message = decode(line) if line.strip() else None
            if message is not None:
                messages.append(message)
        return messages

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self._bell is not None:
                self._bell.close()
                self._bell = None
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        # the reader holds the descriptor too: without this the socket is closed in name only,
        # its descriptor kept until the collector frees the reader (a runner ran out of them)
        if self._reader is not None:
            with contextlib.suppress(OSError, ValueError):
                self._reader.close()


def write_controller_address(state_dir: Path, host: str, port: int, pid: int) -> None:
    """Written whole, then moved into place. The temporary file is this process's own: agents
    started by hand at once on one state directory each write it (with one name, one agent's
    move took the file another was about to move, and that agent died of it in CI)."""
    path = StateDir(state_dir).controller_address
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"host": host, "port": port, "pid": pid}))
    tmp.replace(path)


def controller_address(state_dir: Path) -> tuple[str, int] | None:
    try:
        data = json.loads(StateDir(state_dir).controller_address.read_text())
        return str(data["host"]), int(data["port"])
    except (OSError, ValueError, KeyError):
        return None
