"""The controller's socket: agents and launchers connect to it, and their messages are read in
the controller's own loop, one selector for every connection (no thread per peer).

Reading every ready connection in one place keeps the controller fair under load: when it gets
the CPU back after a stall, it reads what each peer sent before any check runs, so a starved
controller never takes its own lateness for a silent node.
"""

from __future__ import annotations

import contextlib
import selectors
import socket

from relaunch.protocol.messages import Message
from relaunch.protocol.wire import Connection

__all__ = ["Listener"]


class Listener:
    def __init__(self, host: str) -> None:
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((host, 0))
        self.server.listen(1024)
        self.server.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ, None)

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

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            if key.data is not None:
                key.data.close()
        self.selector.close()
        self.server.close()
