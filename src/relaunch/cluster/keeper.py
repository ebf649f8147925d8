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

Memory used again: where a copy on its way needs room, the oldest step is dropped as it starts
(not once it has arrived), and the copy is received into the memory of that step's copy of the
same size in pages. Those pages are faulted in already: fresh memory took its pages one fault
at a time as the bytes arrived, at 0.2-0.5 of the link's speed on this project's machine, and
the dropped step's memory took the same copy 2 to 8 times as fast (docs/benchmark-history.md, runs 20-21).
The dropped step's other copies stay as spare memory, counted in the job's budget, for its other
ranks' copies of the new step; so a job's copies on this node, those on their way included,
stay within its budget, where fresh memory for each arriving copy held a step more. A copy
being read is never used again: it goes once its reader is done.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import socket
import socketserver
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
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
POLL_S = 5.0
"""How often an idle keeper's server looks whether it is asked to stop (a request, or the
stop itself, wakes it at once)."""

__all__ = ["PeerMemory", "PeerMemoryServer", "StoredCopy"]


@dataclass(frozen=True)
class StoredCopy:
    job: str
    rank: int
    step: int
    manifest: dict[str, Any]
    data: bytearray | mmap.mmap | memoryview

    @property
    def digest(self) -> str:
        """The hash its manifest gives for it (the reader checks the bytes against it)."""
        (entry,) = self.manifest.get("files", {"": {}}).values()
        return str(entry.get("xxh3_128", ""))


class PeerMemory:
    """The copies themselves, by (job, rank, step), and the memory of dropped ones kept for the
    next copies. Thread-safe; no I/O."""

    def __init__(self) -> None:
        self._copies: dict[tuple[str, int, int], StoredCopy] = {}
        self._lock = threading.Lock()
        self._bad: set[str] = set()
        """Jobs whose copies this memory spoils (a fault plan's `peer-copy-corrupt`)."""
        self._spare: defaultdict[str, list[memoryview]] = defaultdict(list)
        """By job: memory of its dropped copies (each as long as the copy it held), counted in
        its budget, for its next copies of the same size in pages."""
        self._coming: dict[int, tuple[str, int]] = {}
        """By id of the memory given for a copy on its way: its job and size, counted."""
        self._reading: Counter[int] = Counter()
        """By id of a copy: how many readers it has (its memory is not used again meanwhile)."""

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

    def memory_for(self, job: str, step: int, size: int, budget: int) -> memoryview:
        """Memory to receive `job`'s copy of `step`, `size` bytes, into: a spare of the same size
        in pages; else, where the job has no room for it within `budget`, the memory of a copy
        of the oldest step, dropped now for it (its other copies kept as spares); else fresh
        memory (pages rounded up, so that a copy a few bytes longer fits it next time). Counted
        in the job's budget until `put` keeps it or `give_back` returns it."""
        with self._lock:
            memory = self._take_spare(job, size)
            while memory is None and self._used(job) + size > budget:
                if self._spare[job]:  # of other sizes: room from them (oldest first) before a copy
                    self._spare[job].pop(0)
                elif self._drop_oldest(job, before=step, spare=True):
                    memory = self._take_spare(job, size)
                else:
                    break  # nothing older to make room with: `put` decides
            if memory is None:
                memory = memoryview(_fresh(size))[:size]
            self._coming[id(memory)] = (job, size)
        return memory

    def give_back(self, memory: memoryview, budget: int) -> None:
        """Memory `memory_for` gave that holds no kept copy (its bytes torn on the way, or the
        copy refused): a spare of its job where the budget has room, else it goes."""
        with self._lock:
            coming = self._coming.pop(id(memory), None)
            if coming is not None and self._used(coming[0]) + len(memory) <= budget:
                self._spare[coming[0]].append(memory)

    def put(self, copy: StoredCopy, budget: int) -> str | None:
        """Keep `copy`, within `budget` bytes for its job; the reason it was refused, or None."""
        size = len(copy.data)
        if size > budget:
            return f"a copy of {size} bytes is more than the job's {budget} bytes on this node"
        with self._lock:
            self._coming.pop(id(copy.data), None)
            self._copies.pop((copy.job, copy.rank, copy.step), None)
            while self._used(copy.job) + size > budget:
                if self._spare[copy.job]:  # room first from memory no copy holds, oldest first
                    self._spare[copy.job].pop(0)
                elif not self._drop_oldest(copy.job, before=copy.step, spare=False):
                    break
            used = self._used(copy.job)
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

    @contextlib.contextmanager
    def lent(self, job: str, rank: int, step: int) -> Iterator[StoredCopy | None]:
        """The copy (None where there is none) for as long as it is read: dropped meanwhile,
        its memory is never used again for another copy."""
        with self._lock:
            found = self._copies.get((job, rank, step))
            if found is not None:
                self._reading[id(found)] += 1
        try:
            yield found
        finally:
            if found is not None:
                with self._lock:
                    self._reading[id(found)] -= 1
                    if not self._reading[id(found)]:
                        del self._reading[id(found)]

    def used(self, job: str) -> int:
        """The job's bytes here: its copies, its spare memory and its copies on their way."""
        with self._lock:
            return self._used(job)

    def _used(self, job: str) -> int:
        held = sum(len(c.data) for c in self._copies.values() if c.job == job)
        coming = sum(size for j, size in self._coming.values() if j == job)
        return held + sum(len(m) for m in self._spare[job]) + coming

    def _drop_oldest(self, job: str, before: int, spare: bool) -> bool:
        """Drop the job's oldest step older than `before`, its copies' memory kept as spares
        (`spare`, those not being read and held in pages of their own) or let go; False where
        it holds none."""
        steps = [c.step for c in self._copies.values() if c.job == job and c.step < before]
        if not steps:
            return False
        oldest = min(steps)
        for key in [k for k, c in self._copies.items() if c.job == job and c.step == oldest]:
            dropped = self._copies.pop(key)
            if spare and id(dropped) not in self._reading and isinstance(dropped.data, memoryview):
                self._spare[job].append(dropped.data)
        return True

    def _take_spare(self, job: str, size: int) -> memoryview | None:
        """A spare of the job's as long as `size` in pages (then `size` bytes of it), or None."""
        spares = self._spare[job]
        for i, memory in enumerate(spares):
            if isinstance(memory.obj, mmap.mmap) and len(memory.obj) == _pages(size):
                del spares[i]
                return memoryview(memory.obj)[:size]
        return None

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


def _pages(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def _fresh(size: int) -> mmap.mmap | bytearray:
    """Fresh memory for a copy of `size` bytes, as long as its pages."""
    return memory_for(_pages(size))


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
            step = int(header["step"])
            data = memory.memory_for(job, step, size, budget)
            error: str | None = "not received"
            try:
                receive_into(sock, data)  # a copy torn on the way is never kept
                error = memory.put(
                    StoredCopy(job, int(header["rank"]), step, header["manifest"], data), budget
                )
            except PeerMemoryError:
                return
            finally:
                if error is not None:
                    memory.give_back(data, budget)
            send_header(sock, {"ok": error is None, "error": error})
        elif op == "index":
            send_header(sock, {"ok": True, "copies": memory.index(job)})
        elif op == "get":
            with memory.lent(job, int(header["rank"]), int(header["step"])) as found:
                if found is None:
                    send_header(sock, {"ok": False, "error": "no such copy"})
                    return
                answer = {"ok": True, "size": len(found.data), "manifest": found.manifest}
                send_header(sock, answer)
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
        # an idle keeper wakes once every POLL_S (it woke 10 times a second: 0.8 ms of CPU a
        # second, a third of an agent's); a request wakes it at once, and so does `shutdown`
        serve = functools.partial(self.serve_forever, poll_interval=POLL_S)
        threading.Thread(target=serve, name="peer-memory", daemon=True).start()
        return self

    def shutdown(self) -> None:
        """Stop serving now, not at the next poll: a connection of its own ends the poll's wait
        once the stop is asked for (its handler reads nothing and is done)."""
        stopping = threading.Thread(target=super().shutdown, daemon=True)
        stopping.start()
        while stopping.is_alive():
            with contextlib.suppress(OSError):
                socket.create_connection(self.address, timeout=1.0).close()
            stopping.join(0.05)
