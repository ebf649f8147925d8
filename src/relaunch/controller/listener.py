"""The controller's socket: agents and launchers connect to it, and their messages are read in
the controller's own loop, one selector for every connection (no thread per peer).

Reading every ready connection in one place keeps the controller fair under load: when it gets
the CPU back after a stall, it reads what each peer sent before any check runs, so a starved
controller never takes its own lateness for a silent node.

While the job trains undisturbed the controller reads only a few times a second (`wait_quietly`):
it sleeps through the routine messages (heartbeats, progress, output) and wakes early for its
doorbell (a peer sent a message that needs the controller now, see protocol.wire), a new
connection, or a peer closing its connection (a launcher or an agent that died).
"""

from __future__ import annotations

import contextlib
import select
import selectors
import socket

from relaunch.protocol.messages import Message
from relaunch.protocol.wire import Connection

__all__ = ["Listener"]

ACCEPT_QUEUE = 65535


class Listener:
    def __init__(self, host: str, port: int = 0) -> None:
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((host, port))
        # every launcher of a large job connects at once after a job-level recovery or a
        # controller's restart: a full accept queue drops their SYNs, and each dropped one
        # waits a second before it tries again (the kernel caps this at net.core.somaxconn)
        self.server.listen(ACCEPT_QUEUE)
        self.server.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ, None)
        self.doorbell = _doorbell(self.server.getsockname()[:2])
        self._quiet = select.epoll()
        self._quiet.register(self.server.fileno(), select.EPOLLIN)
        if self.doorbell is not None:
            self._quiet.register(self.doorbell.fileno(), select.EPOLLIN)

    @property
    def rings(self) -> bool:
        """The doorbell listens: a quiet wait wakes for urgent messages."""
        return self.doorbell is not None

    def wait_quietly(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds unless the doorbell rings, a peer connects or a peer's
        connection closes; routine messages wait on their sockets meanwhile. True if woken."""
        woken = bool(self._quiet.poll(max(0.0, timeout)))
        if self.doorbell is not None:
            while True:
                try:
                    self.doorbell.recv(64)
                except OSError:  # BlockingIOError: every bell read
                    break
        return woken

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.getsockname()
        return str(host), int(port)

    def poll(self, wait: float) -> list[tuple[Connection, Message | None]]:
        """What the peers sent, waiting up to `wait` seconds for something: each message with
        its connection, and (connection, None) for a connection that closed."""
        received: list[tuple[Connection, Message | None]] = []
        for key, _ in self.selector.select(wait):
            if key.data is None:
                self._accept()
                continue
            conn: Connection = key.data
            messages = conn.read_ready()
            if messages is None:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self.selector.unregister(key.fd)
                with contextlib.suppress(OSError):
                    self._quiet.unregister(key.fd)
                received.append((conn, None))
            else:
                received.extend((conn, message) for message in messages)
        return received

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(True)  # sends block; reads happen only once the socket is readable
            conn = Connection(sock)
            self.selector.register(conn.fileno(), selectors.EVENT_READ, conn)
            self._quiet.register(conn.fileno(), select.EPOLLRDHUP)  # its closing, not its data

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            if key.data is not None:
                key.data.close()
        self.selector.close()
        self._quiet.close()
        if self.doorbell is not None:
            self.doorbell.close()
        self.server.close()


def _doorbell(address: tuple[str, int]) -> socket.socket | None:
    """A UDP socket on the listener's own port number; None where that port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock
