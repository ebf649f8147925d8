"""A node's peer memory: copies of other nodes' ranks' checkpoints, kept in its agent's memory.

A rank's checkpoint is saved to storage and, where the job's spec asks for it
(`peer_memory_mb`), also copied here, into another node's agent, over the nodes' data link
(relaunch.protocol.peer_memory says the wire; relaunch.train.peer is the rank's side). A
replaced rank reads it back from here at memory and link speed instead of from storage; it
checks the copy against the checkpoint's manifest itself, so nothing here is trusted.

Bounded: one job's copies on one node stay within the budget the job's ranks send with each
copy; a new step's copy makes room by dropping the oldest steps first, and a copy that finds no
room (it is older than all the node keeps, or larger than the budget) is refused. The copies
live as long as the agent: a lost node loses them, and its ranks' restores fall back to storage.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import socket
import socketserver
import threading
from dataclasses import dataclass
from typing import Any

from relaunch.protocol.peer_memory import (
    PeerMemoryError,
    memory_for,
    read_header,
    receive_into,
    send_header,
    stall_timeout,
)

STALL_S = 60.0
"""A transfer that makes no progress for this long is given up (its copy never kept)."""

__all__ = ["PeerMemory", "PeerMemoryServer", "StoredCopy"]


@dataclass(frozen=True)
class StoredCopy:
    job: str
    rank: int
    step: int
    manifest: dict[str, Any]
    data: bytearray | mmap.mmap

    @property
    def digest(self) -> str:
        """The hash its manifest gives for it (the reader checks the bytes against it)."""
        (entry,) = self.manifest.get("files", {"": {}}).values()
        return str(entry.get("xxh3_128", ""))


class PeerMemory:
    """The copies themselves, by (job, rank, step). Thread-safe; no I/O."""

    def __init__(self) -> None:
        self._copies: dict[tuple[str, int, int], StoredCopy] = {}
        self._lock = threading.Lock()
        self._bad: set[str] = set()
        """Jobs whose copies this memory spoils (a fault plan's `peer-copy-corrupt`)."""

    def go_bad(self, job: str) -> int:
        """From now on, as a failing memory module would, one byte of each copy of `job` held
        here, now or later, is flipped (the fault plan's `peer-copy-corrupt`; its readers'
        checksums must refuse them). How many copies it spoiled now."""
        with self._lock:
            self._bad.add(job)
            mine = [c for c in self._copies.values() if c.job == job]
            for copy in mine:
                _flip(copy)
        return len(mine)

    def put(self, copy: StoredCopy, budget: int) -> str | None:
        """Keep `copy`, within `budget` bytes for its job; the reason it was refused, or None."""
        size = len(copy.data)
        if size > budget:
            return f"a copy of {size} bytes is more than the job's {budget} bytes on this node"
        with self._lock:
            self._copies.pop((copy.job, copy.rank, copy.step), None)
            mine = [c for c in self._copies.values() if c.job == copy.job]
            used = sum(len(c.data) for c in mine)
            for step in sorted({c.step for c in mine}):
                if used + size <= budget or step >= copy.step:
                    break
                for old in [c for c in mine if c.step == step]:
                    del self._copies[(old.job, old.rank, old.step)]
                    used -= len(old.data)
            if used + size > budget:
                return (
                    f"no room for step {copy.step}: the job's {used} bytes of newer or equal "
                    f"steps and this copy's {size} exceed its {budget} bytes on this node"
                )
            if copy.job in self._bad:
                _flip(copy)
            self._copies[(copy.job, copy.rank, copy.step)] = copy
        return None

    def get(self, job: str, rank: int, step: int) -> StoredCopy | None:
        with self._lock:
            return self._copies.get((job, rank, step))

    def index(self, job: str) -> list[tuple[int, int, int, str]]:
        """(rank, step, size, hash) of each of the job's copies."""
        with self._lock:
            return sorted(
                (c.rank, c.step, len(c.data), c.digest)
                for c in self._copies.values()
                if c.job == job
            )

    def size(self) -> int:
        with self._lock:
            return sum(len(c.data) for c in self._copies.values())


def _flip(copy: StoredCopy) -> None:
    """One bit of the middle byte of the copy (in a tensor's bytes, for a checkpoint)."""
    if len(copy.data):
        copy.data[len(copy.data) // 2] ^= 0x01


class _Handler(socketserver.BaseRequestHandler):
    server: PeerMemoryServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stall_timeout(sock, STALL_S)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            self._answer(sock, read_header(sock))

    def _answer(self, sock: socket.socket, header: dict[str, Any]) -> None:
        memory = self.server.memory
        op, job = header.get("op"), str(header.get("job", ""))
        if op == "put":
            size, budget = int(header["size"]), int(header["budget"])
            if not 0 <= size <= budget:  # refused before a byte of it is taken in
                send_header(sock, {"ok": False, "error": f"{size} bytes: not within {budget}"})
                return
            data = memory_for(size)
            try:
                receive_into(sock, data)  # a copy torn on the way is never kept
            except PeerMemoryError:
                return
            copy = StoredCopy(
                job, int(header["rank"]), int(header["step"]), header["manifest"], data
            )
            error = memory.put(copy, budget)
            send_header(sock, {"ok": error is None, "error": error})
        elif op == "index":
            send_header(sock, {"ok": True, "copies": memory.index(job)})
        elif op == "get":
            found = memory.get(job, int(header["rank"]), int(header["step"]))
            if found is None:
                send_header(sock, {"ok": False, "error": "no such copy"})
                return
            send_header(sock, {"ok": True, "size": len(found.data), "manifest": found.manifest})
            sock.sendall(found.data)
        else:
            send_header(sock, {"ok": False, "error": f"unknown op {op!r}"})


class PeerMemoryServer(socketserver.ThreadingTCPServer):
    """Serves a `PeerMemory` on `host` (the node's data address), one thread a connection."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, memory: PeerMemory | None = None, port: int = 0) -> None:
        self.memory = memory if memory is not None else PeerMemory()
        super().__init__((host, port), _Handler)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server_address[:2]
        return str(host), int(port)

    def start(self) -> PeerMemoryServer:
        # polled every 0.1 s, not socketserver's 0.5: an agent's shutdown waits for the poll
        serve = functools.partial(self.serve_forever, poll_interval=0.1)
        threading.Thread(target=serve, name="peer-memory", daemon=True).start()
        return self
