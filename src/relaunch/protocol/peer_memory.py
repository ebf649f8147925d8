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
import json
import mmap
import socket
import struct
from typing import Any, Final

__all__ = [
    "MAX_HEADER",
    "PeerMemoryError",
    "memory_for",
    "parse_peers",
    "read_header",
    "receive_into",
    "send_header",
    "stall_timeout",
]

MAX_HEADER: Final = 1 << 20
"""A header longer than this is refused before it is read."""


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
