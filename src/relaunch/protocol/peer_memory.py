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

import json
import socket
import struct
from typing import Any, Final

__all__ = [
    "MAX_HEADER",
    "PeerMemoryError",
    "parse_peers",
    "read_header",
    "receive_into",
    "send_header",
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


def receive_into(sock: socket.socket, buffer: bytearray | memoryview) -> None:
    """Fill `buffer` from `sock`, or raise PeerMemoryError if the peer stops before."""
    view = memoryview(buffer)
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise PeerMemoryError(f"the peer closed with {len(view)} bytes still to come")
        view = view[got:]


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
