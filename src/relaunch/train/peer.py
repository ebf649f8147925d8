"""A rank's side of peer memory: its checkpoint copied into another node's memory after each
save, and read back from there at a restore (relaunch.cluster.keeper keeps the copies;
relaunch.protocol.peer_memory is the wire).

Where the copy goes: the node after the rank's own, in the order of the nodes' names, among the
nodes whose peer memory the rank was given; never the rank's own node, so that no node holds
both a rank's state and its only copy. Where it is read from: any node that has it (a moved rank
runs on another node than the one that saved). Nothing read is trusted: the checkpoint manager
checks each copy against the manifest on storage before it loads a byte of it.

Importable without torch; standard library only.
"""

from __future__ import annotations

import functools
import mmap
import os
import socket
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from relaunch.protocol.environment import Env
from relaunch.protocol.peer_memory import (
    PeerMemoryError,
    ReadyMemory,
    memory_for,
    parse_peers,
    read_header,
    receive_into,
    send_header,
    stall_timeout,
)
from relaunch.train.background import NewestOnly

__all__ = ["FetchedCopy", "PeerCopies"]

CONNECT_TIMEOUT_S = 5.0
"""How long a rank waits for a peer's memory to accept: a lost node's address does not answer."""
GASP_COPY_WAIT_S = 5.0
"""How long a dying gasp waits for its copy to reach the peer before the process exits."""
KEPT_RECORDS = 64
"""How many copies sent, and failures, a rank remembers: a job saves for days."""
IO_TIMEOUT_S = 60.0
"""How long one read or write of a transfer may stall before the peer counts as lost."""


@dataclass(frozen=True)
class FetchedCopy:
    node: str
    manifest: dict[str, Any]
    data: bytearray | mmap.mmap


class PeerCopies:
    """One rank's copies in its peers' memory (`from_env`: None where the job does not keep any)."""

    def __init__(
        self, job: str, node: str, peers: Mapping[str, tuple[str, int]], budget: int
    ) -> None:
        self.job = job
        self.node = node
        self.peers = dict(peers)
        self.budget = budget
        self._sender = NewestOnly()
        self.sent: deque[tuple[int, str]] = deque(maxlen=KEPT_RECORDS)
        """(step, node) of the newest copies a peer kept, newest last (for tests and diagnosis)."""
        self.failures: deque[str] = deque(maxlen=KEPT_RECORDS)
        """Why a copy was not kept, for the newest that were not."""
        self.unreachable: set[str] = set()
        """Nodes whose memory did not answer this rank's last copy to them."""
        self.ready: ReadyMemory | None = None
        """The memory `prepare` is making ready for a restore's copy (None: none asked for)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PeerCopies | None:
        environ = os.environ if environ is None else environ
        peers = parse_peers(environ.get(Env.PEER_MEMORY, ""))
        budget = int(environ.get(Env.PEER_MEMORY_BYTES, "0") or 0)
        job = environ.get(Env.JOB_ID, "")
        if not peers or budget <= 0 or not job:
            return None
        return cls(job, environ.get(Env.NODE, ""), peers, budget)

    def target(self) -> str | None:
        """The node this rank's copies go to: the next one after its own (None: no other)."""
        order = self.candidates()
        return order[0] if order else None

    def candidates(self) -> list[str]:
        """Where a copy may go, in the order tried: the nodes after this rank's own, round the
        ring (the first is the target), those whose memory did not answer last time at the
        end: a lost target (its node gone with the copies it held) is passed over for the next
        node, whose memory a replaced rank's restore asks as well."""
        others = sorted(n for n in self.peers if n != self.node)
        ring = [n for n in others if n > self.node] + [n for n in others if n < self.node]
        return [n for n in ring if n not in self.unreachable] + [
            n for n in ring if n in self.unreachable
        ]

    # -- copying -----------------------------------------------------------------------------------

    def copy(self, rank: int, step: int, manifest: dict[str, Any], path: Path) -> None:
        """Copy the shard at `path` to the target's memory in the background. A copy still
        waiting when the next comes is replaced by it: the loop never waits for a peer."""
        self.release_ready()  # a rank that saves is past its restore
        self._sender.submit(functools.partial(self._send, rank, step, manifest, path))

    def wait(self, timeout: float | None = None) -> bool:
        """Until the copies asked for so far were sent (or failed), at most `timeout` seconds;
        False if one is still on its way."""
        return self._sender.wait(timeout)

    def _send(self, rank: int, step: int, manifest: dict[str, Any], path: Path) -> None:
        order = self.candidates()
        if not order:
            self.failures.append(f"step {step}: no other node's memory to copy to")
            return
        for node in order:
            try:
                sock = self._connect(node)
            except OSError as error:  # its node is lost (or its agent is): the next node's
                self.unreachable.add(node)
                self.failures.append(f"step {step} to {node}: {error}")
                continue
            self.unreachable.discard(node)
            try:
                with sock, open(path, "rb") as f:
                    self._put(sock, f, rank, step, manifest)
                self.sent.append((step, node))
            except (OSError, ValueError) as error:  # the copy is an extra: the save stands
                self.failures.append(f"step {step} to {node}: {error}")
            return

    def _put(
        self, sock: socket.socket, f: BinaryIO, rank: int, step: int, manifest: dict[str, Any]
    ) -> None:
        size = os.fstat(f.fileno()).st_size
        header = {"op": "put", "job": self.job, "rank": rank, "step": step}
        send_header(sock, {**header, "manifest": manifest, "size": size, "budget": self.budget})
        sock.sendfile(f)
        answer = read_header(sock)
        if not answer.get("ok"):
            raise PeerMemoryError(str(answer.get("error")))

    # -- reading back ------------------------------------------------------------------------------

    def prepare(self, rank: int) -> None:
        """Make memory ready, in the background, for `rank`'s newest copy a peer holds (none
        where no peer holds one: a first start), so that a restore receives it into pages
        already faulted in (relaunch.protocol.peer_memory.ReadyMemory). The checkpoint manager
        asks as it is made: the sooner a rank makes it, the more of its start this overlaps."""
        self.ready = ReadyMemory(functools.partial(self._newest_size, rank))

    def release_ready(self) -> None:
        """The memory `prepare` made ready goes: no restore is coming (the rank trains)."""
        ready, self.ready = self.ready, None
        if ready is not None:
            ready.release()

    def _newest_size(self, rank: int) -> int:
        """The size of `rank`'s newest copy that a peer holds; 0 where none does."""
        sizes = {
            int(step): int(size)
            for _, copies in self._listed()
            for copy_rank, step, size, _digest in copies
            if int(copy_rank) == rank
        }
        return sizes[max(sizes)] if sizes else 0

    def index(self) -> dict[tuple[int, int], list[tuple[str, str]]]:
        """Every copy of the job the peers say they hold: (rank, step) -> [(node, hash)], the
        target's first. A peer that does not answer holds nothing."""
        found: dict[tuple[int, int], list[tuple[str, str]]] = {}
        for node, copies in self._listed():
            for rank, step, _size, digest in copies:
                found.setdefault((int(rank), int(step)), []).append((node, str(digest)))
        return found

    def _listed(self) -> list[tuple[str, list[Any]]]:
        """(node, its `index` answer) for every peer, the target's first, asked all at once."""

        def listed(node: str) -> list[Any]:
            try:
                with self._connect(node) as sock:
                    send_header(sock, {"op": "index", "job": self.job})
                    return list(read_header(sock).get("copies", []))
            except (OSError, ValueError):
                return []

        from concurrent.futures import ThreadPoolExecutor  # only at a restore: not on every start

        target = self.target()
        nodes = sorted(self.peers, key=lambda n: (n != target, n))
        with ThreadPoolExecutor(max_workers=min(16, len(nodes) or 1)) as pool:
            return list(zip(nodes, pool.map(listed, nodes), strict=True))

    def restore(
        self,
        rank: int,
        step: int,
        manifest: dict[str, Any],
        read: Callable[[bytearray | mmap.mmap, str], Any],
    ) -> tuple[Any, str | None, list[str]]:
        """`rank`'s state of `step` from the first peer whose copy is the one `manifest` (the
        storage's) describes, read with `read(bytes, hash)`, which checks every byte against the
        hash before it loads any: (state, node, refusals), or (None, None, refusals) where no peer
        served. A copy of another step, a torn one or one altered in memory is refused (its
        reason in `refusals`), and the next holder is asked."""
        ((_, expected),) = manifest["files"].items()
        refusals: list[str] = []
        holders = self.index().get((rank, step), [])
        ready, self.ready = self.ready, None  # the first copy received lands in it
        try:
            for node, _digest in holders:
                try:
                    copy = self.fetch(node, rank, step, ready)
                    if copy.manifest.get("files") != manifest["files"]:
                        raise PeerMemoryError(
                            "its manifest is not the one on storage (another save)"
                        )
                    if len(copy.data) != expected["size"]:
                        raise PeerMemoryError(
                            f"{len(copy.data)} bytes where the manifest says {expected['size']}"
                        )
                    return read(copy.data, expected["xxh3_128"]), node, refusals
                except (OSError, ValueError) as error:
                    refusals.append(f"the copy in {node}'s memory was refused: {error}")
            return None, None, refusals
        finally:
            if ready is not None:  # not taken (no peer served): its memory goes now
                ready.release()

    def fetch(
        self, node: str, rank: int, step: int, ready: ReadyMemory | None = None
    ) -> FetchedCopy:
        """`rank`'s copy of `step` from `node`'s memory, as it sent it: not checked here. Its
        bytes land in `ready`'s memory where it is the copy's size, else in fresh memory."""
        with self._connect(node) as sock:
            send_header(sock, {"op": "get", "job": self.job, "rank": rank, "step": step})
            answer = read_header(sock)
            if not answer.get("ok"):
                raise PeerMemoryError(f"{node}: {answer.get('error')}")
            size = int(answer["size"])
            data = ready.take(size) if ready is not None else memory_for(size)
            receive_into(sock, data)
        return FetchedCopy(node, dict(answer.get("manifest") or {}), data)

    def _connect(self, node: str) -> socket.socket:
        sock = socket.create_connection(self.peers[node], timeout=CONNECT_TIMEOUT_S)
        stall_timeout(sock, IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
