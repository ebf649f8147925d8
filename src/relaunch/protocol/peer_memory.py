"""The wire of peer memory: a rank's checkpoint copied into another node's agent, and read back.

Each node's agent keeps copies of other nodes' ranks' checkpoints in its memory
(relaunch.cluster.keeper) and listens on the node's data link; the training SDK
(relaunch.train.peer) sends a shard there after it saved it and asks for it back at a restore.
One request per connection: a 4-byte big-endian length, a JSON header, then for a `put` the
shard's bytes. The answer is a header the same way (`{"ok": true, ...}` or `{"ok": false,
"error": ...}`), then for a `get` the copy's bytes.

Requests:

- ``{"op": "put", "job", "rank", "step", "manifest", "size", "budget"}`` + ``size`` bytes: keep
  this copy; the job's copies on this node stay within ``budget`` bytes, the oldest step going
  first. A copy whose bytes did not all arrive is never kept.
- ``{"op": "index", "job"}``: ``{"copies": [[rank, step, size, hash], ...]}``.
- ``{"op": "get", "job", "rank", "step"}``: ``{"size", "manifest"}`` + the bytes.

Standard library only (every training process imports it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

__all__ = [
    "MAX_HEADER",
    "PeerMemoryError",
    "ReadyMemory",
    "fault_in",
    "memory_for",
    "parse_peers",
    "read_header",
    "receive_into",
    "send_header",
    "stall_timeout",
]

MAX_HEADER: Final = 1 << 20
"""A header longer than this is refused before it is read."""
FAULT_IN_CHUNK: Final = 8 << 20
"""How much memory `ReadyMemory` faults in between two looks at whether it is wanted now."""
_MADV_POPULATE_WRITE: Final = 23
"""Linux 5.14's madvise that faults pages in writable without touching them (Python 3.11's mmap
has no name for it)."""


class PeerMemoryError(OSError):
    """A peer's memory could not be reached, or answered with an error or a short read."""


def send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def read_header(sock: socket.socket) -> dict[str, Any]:
    (length,) = struct.unpack(">I", _exactly(sock, 4))
    if length > MAX_HEADER:
        raise PeerMemoryError(f"a header of {length} bytes is longer than {MAX_HEADER}")
    header = json.loads(_exactly(sock, length))
    if not isinstance(header, dict):
        raise PeerMemoryError("a header that is not a JSON object")
    return header


def memory_for(size: int) -> mmap.mmap | bytearray:
    """Fresh memory for `size` bytes received from a socket: anonymous memory in huge pages
    where the kernel gives them. A `bytearray` of the same size took its pages one fault at a
    time as the bytes arrived, and received at a third of the link's speed (256 MB: 0.35-0.6
    GB/s against 1.3-1.7 on the embedded cluster's data link)."""
    if size <= 0:
        return bytearray(size)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without huge pages: small ones, slower
            memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def fault_in(memory: Any) -> None:
    """Fault every page of `memory` (a writable buffer) in, its bytes unchanged: the kernel's
    MADV_POPULATE_WRITE where it has one (the interpreter's lock released meanwhile), else each
    page's first byte read and written back. Fresh memory that the receiving of a copy faults in
    as the bytes arrive held the restore to 0.37-0.93 of the link's speed on this project's
    machine, whose host had taken the pages back (docs/benchmark-history.md, runs 14-15)."""
    view = memoryview(memory).cast("B")
    if not view:
        return
    populate = _populate()
    if populate is not None:
        import ctypes

        anchor = ctypes.c_char.from_buffer(view)
        try:
            if populate(ctypes.addressof(anchor), len(view), _MADV_POPULATE_WRITE) == 0:
                return
        finally:
            del anchor
    view[:: mmap.PAGESIZE] = bytes(view[:: mmap.PAGESIZE])


@functools.cache
def _populate() -> Callable[[int, int, int], int] | None:
    """libc's madvise, where this is Linux (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


class ReadyMemory:
    """Memory for a copy still to come, made ready ahead by a thread of its own: its size asked
    of `size_of` (0: none is coming), then mapped (`memory_for`) and faulted in, a chunk at a
    time, while the process does its other work (a restarted rank: its rendezvous, its model), so
    that the copy's bytes land in pages already there. `take` stops the thread wherever it is
    and hands over what is ready: the rest faults in as the bytes arrive, as in fresh memory."""

    def __init__(self, size_of: Callable[[], int]) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held while a chunk faults in: no byte lands under it
        self._memory: mmap.mmap | bytearray | None = None
        self.faulted = 0
        """Bytes faulted in so far."""
        self.taken = False
        """Whether a transfer took this memory (rather than fresh memory of another size)."""
        self._thread = threading.Thread(
            target=self._prepare, args=(size_of,), name="relaunch-ready-memory", daemon=True
        )
        self._thread.start()

    @property
    def held(self) -> int:
        """Bytes of memory held for the copy (0: none is, or it was taken or released)."""
        memory = self._memory
        return len(memory) if memory is not None else 0

    def wait(self, timeout: float | None = None) -> bool:
        """Until the memory is all faulted in, or none is coming; False if it is still faulting."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def take(self, size: int) -> mmap.mmap | bytearray:
        """The memory, for `size` bytes: what was made ready, if it is of that size, else fresh."""
        self._stop.set()
        with self._lock:
            memory, self._memory = self._memory, None
        if memory is not None and len(memory) == size:
            self.taken = True
            return memory
        return memory_for(size)

    def release(self) -> None:
        """No copy is coming after all (the rank saved): the memory goes."""
        self._stop.set()
        with self._lock:
            self._memory = None

    def _prepare(self, size_of: Callable[[], int]) -> None:
        try:
            size = size_of()
        except (OSError, ValueError, TypeError):  # a peer's answer that does not parse: none
            return
        if size <= 0 or self._stop.is_set():
            return
        try:
            memory = memory_for(size)
        except (OSError, OverflowError, MemoryError):  # no room now: the copy gets fresh memory
            return
        view = memoryview(memory)
        with self._lock:
            if self._stop.is_set():
                return
            self._memory = memory
        for start in range(0, size, FAULT_IN_CHUNK):
            with self._lock:
                if self._stop.is_set():
                    return
                fault_in(view[start : start + FAULT_IN_CHUNK])
                self.faulted = min(size, start + FAULT_IN_CHUNK)


def receive_into(sock: socket.socket, buffer: bytearray | memoryview | mmap.mmap) -> None:
    """Fill `buffer` from `sock`, or raise PeerMemoryError if the peer stops before. One call
    waits for the whole buffer (MSG_WAITALL): the kernel copies each packet in as it comes, where
    a call for whatever has arrived ran the link at a third of its speed. Use it on a blocking
    socket (`stall_timeout` bounds it)."""
    view = memoryview(buffer).cast("B")
    while view:
        got = sock.recv_into(view, min(len(view), 1 << 30), socket.MSG_WAITALL)
        if got == 0:
            raise PeerMemoryError(f"the peer closed with {len(view)} bytes still to come")
        view = view[got:]


def stall_timeout(sock: socket.socket, seconds: float) -> None:
    """A blocking `sock` whose every read and write fails after `seconds` without progress
    (SO_RCVTIMEO, SO_SNDTIMEO), so that a peer lost mid-transfer is noticed."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    receive_into(sock, buffer)
    return bytes(buffer)


def parse_peers(text: str) -> dict[str, tuple[str, int]]:
    """``node=host:port,...`` (Env.PEER_MEMORY) as a map; entries that do not parse are left out."""
    peers: dict[str, tuple[str, int]] = {}
    for entry in text.split(","):
        node, _, address = entry.partition("=")
        host, _, port = address.rpartition(":")
        if node and host and port.isdigit():
            peers[node] = (host, int(port))
    return peers
