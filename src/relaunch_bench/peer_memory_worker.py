"""The processes of the peer-memory benchmark (relaunch_bench.peer_memory), each started inside
a node's network namespace: a node's keeper, the link's raw sender and receiver, the rank that
saves, and the fresh rank that restores. Each prints one JSON line.

    python -m relaunch_bench.peer_memory_worker keeper HOST
    python -m relaunch_bench.peer_memory_worker send HOST BYTES
    python -m relaunch_bench.peer_memory_worker receive HOST PORT BYTES
    python -m relaunch_bench.peer_memory_worker save DIR MB PEER_HOST:PORT [stall=PAIRS]
    python -m relaunch_bench.peer_memory_worker copy-again DIR MB PEER_HOST:PORT
    python -m relaunch_bench.peer_memory_worker restore DIR PEER_HOST:PORT|local|storage MB [late]
    python -m relaunch_bench.peer_memory_worker restore DIR PEER_HOST:PORT MB together
    python -m relaunch_bench.peer_memory_worker shared-read SERVER KEY DIR
    python -m relaunch_bench.peer_memory_worker shared-restore SERVER KEY DIR MB

The last two read DIR from the storage node's file server (relaunch_bench.file_server), mounted
in this process's own mount namespace for their run.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from relaunch.protocol.peer_memory import fault_in, memory_for, receive_into, stall_timeout
from relaunch_bench.file_server import FileServer, mounted

JOB = "bench"
RECEIVES = ("as a restore receives", "the link alone")
"""The link's raw transfers a measure takes, in this order (`receive`)."""


def _say(**values: Any) -> None:
    print(json.dumps(values), flush=True)


def keeper(host: str) -> None:
    from relaunch.cluster.keeper import PeerMemoryServer

    server = PeerMemoryServer(host).start()
    _say(port=server.address[1])
    sys.stdin.read()  # until the benchmark closes our stdin


def send(host: str, size: int) -> None:
    """Serve the same memory to `RECEIVES` connections, one after the other."""
    data = memory_for(size)
    fault_in(data)  # its pages in before the first byte is timed
    with socket.create_server((host, 0)) as server:
        _say(port=server.getsockname()[1])
        for _ in RECEIVES:
            conn, _ = server.accept()
            with conn:
                _as_peers_do(conn)
                conn.sendall(data)


def _as_peers_do(sock: socket.socket) -> None:
    """The socket settings of peer memory's own transfers (relaunch.train.peer, cluster.keeper):
    the link's raw speed is measured as they use it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stall_timeout(sock, 60.0)


def receive(host: str, port: int, size: int) -> None:
    """The link's raw speed, twice from the same sender: first into fresh memory, as a restore
    receives (its pages faulted in as the bytes arrive), then into memory already faulted in:
    the link alone, after timing that faulting in (what fresh memory costs on this machine).
    The first is taken first, in a process as fresh as a restoring rank's, and its memory kept
    to the end, so that the second's memory is not the pages the first just freed."""
    timings: dict[str, float] = {}
    with socket.create_connection((host, port)) as sock:
        _as_peers_do(sock)
        start = time.perf_counter()
        receive_into(sock, first := memory_for(size))
        timings["fresh_seconds"] = time.perf_counter() - start
    memory = memory_for(size)
    start = time.perf_counter()
    fault_in(memory)
    timings["fault_in_seconds"] = time.perf_counter() - start
    with socket.create_connection((host, port)) as sock:
        _as_peers_do(sock)
        start = time.perf_counter()
        receive_into(sock, memory)
        timings["alone_seconds"] = time.perf_counter() - start
    del first
    _say(**timings)


def _state(mb: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(mb)
    return {"model": {f"w{i}": torch.randn(mb << 14, generator=generator) for i in range(16)}}


def _peers(peer: str, mb: int, job: str = JOB) -> Any:
    """Rank 0 on node-0, its copies in node-1's memory: room for three steps of its state."""
    from relaunch.train.peer import PeerCopies

    host, _, port = peer.rpartition(":")
    return PeerCopies(job, "node-0", {"node-1": (host, int(port))}, 3 * (mb << 20) + (64 << 20))


def _local(directory: str) -> Any:
    """Rank 0's copies on node-0's own disk (here: this machine's, as storage is)."""
    from relaunch.train.local import LocalCopies

    return LocalCopies(Path(directory) / "local" / "node-0" / f"job-{JOB}", "node-0", keep=3)


def save(directory: str, mb: int, peer: str, stall_pairs: int) -> None:
    """Step 1 saved to storage, then copied to `peer` and to the node's disk, each timed; and
    with `stall_pairs`, the loop's stall in an asynchronous save with and without the copy."""
    from relaunch.train import CheckpointManager

    state = _state(mb)
    manager = CheckpointManager(Path(directory) / "ckpt", rank=0, peers=_peers(peer, mb))
    start = time.perf_counter()
    manager.save(1, state)
    saved = time.perf_counter()
    assert manager.peers is not None and manager.peers.wait(600), "the copy did not end"
    assert manager.peers.sent, manager.peers.failures
    result: dict[str, Any] = {"save_s": saved - start, "copy_s": time.perf_counter() - saved}
    local = _local(directory)  # after the peer's copy, so that neither slows the other
    start = time.perf_counter()
    local.copy(1, "rank-0.ckpt", Path(directory) / "ckpt" / "step-000000001" / "rank-0.ckpt")
    assert local.wait(600) and not local.failures, local.failures
    result["local_copy_s"] = time.perf_counter() - start
    if stall_pairs:
        result.update(_stalls(Path(directory), state, _peers(peer, mb, "stall"), stall_pairs))
    _say(**result)


def copy_again(directory: str, mb: int, peer: str) -> None:
    """The saved step copied twice, as steps 1 and 2, to a keeper with room for one: the first
    into fresh memory, the second into the memory of the first, which the keeper drops as the
    second begins (relaunch.cluster.keeper): a job's copies once its budget is full. The file
    is read once before either, so that both send it from the page cache."""
    from relaunch.train.peer import PeerCopies

    path = Path(directory) / SHARD
    manifest = json.loads(path.with_name("rank-0.manifest.json").read_text())
    host, _, port = peer.rpartition(":")
    peers = PeerCopies("again", "node-0", {"node-1": (host, int(port))}, (mb + 64) << 20)
    with open(path, "rb") as f:  # in the page cache for both, as a save just wrote it
        while f.read(8 << 20):
            pass
    timings = {}
    for step, name in ((1, "copy_fresh_s"), (2, "copy_again_s")):
        start = time.perf_counter()
        peers.copy(0, step, manifest, path)
        assert peers.wait(600), "the copy did not end"
        timings[name] = time.perf_counter() - start
    assert [step for step, _ in peers.sent] == [1, 2], peers.failures
    _say(**timings)


def _stalls(directory: Path, state: Any, peers: Any, pairs: int) -> dict[str, Any]:
    """The loop's wait in an asynchronous save without the copy and with it, `pairs` pairs, steady
    state (after a first pair, in which the manager's first save made its host buffer). One
    manager saves both kinds, its peers switched off and on, so that both copy into the same host
    buffer and write to the same disk (with a manager, and a host buffer, for each kind, the
    ratio moved between 0.93 and 1.17 from run to run, either way); the kinds are taken in turn,
    the order swapped every pair, so that the machine's drift touches both alike; each save is
    written, and copied, and the kernel's writeback of it done (`os.sync`), before the next.
    The medians of each kind and every pair's ratio (pooled over repeats by the benchmark)."""
    from relaunch.train import CheckpointManager

    manager = CheckpointManager(directory / "stall", rank=0, async_save=True, keep=1)
    stalls: dict[str, list[float]] = {"plain": [], "copy": []}
    step = 0
    for pair in range(pairs + 1):
        for kind in ("plain", "copy") if pair % 2 else ("copy", "plain"):
            manager.peers = peers if kind == "copy" else None
            step += 1
            os.sync()  # the last save's pages written back: not flushed under this one's copy
            start = time.perf_counter()
            manager.save(step, state)
            stalls[kind].append(time.perf_counter() - start)
            manager.wait()
            if manager.peers is not None:
                manager.peers.wait(600)
    plain, copy = stalls["plain"][1:], stalls["copy"][1:]  # pair 0: the buffer's first save
    return {
        "stall_plain_s": statistics.median(plain),
        "stall_copy_s": statistics.median(copy),
        "stall_ratios": [c / p for p, c in zip(plain, copy, strict=True)],
    }


def restore(directory: str, peer: str, mb: int, late: bool = False, together: bool = False) -> None:
    """A fresh rank's restore, timed from `load()` to its return. Before it, as a rank does, it
    makes its checkpoint manager and then its model (the state's tensors, drawn afresh), neither
    timed; `late`: the manager made after the model, just before it loads, so that a copy from
    peer memory lands in fresh memory (relaunch.protocol.peer_memory.ReadyMemory). Says which
    tier served and how much of the copy's memory was faulted in when the load began.
    `together`: one of the ranks of a pod that restore at once; it says it is ready, loads once
    its stdin gives the word (the benchmark gives it to all of them at once), and says when its
    load began and ended (the machine's clock: the ranks' wall time together)."""
    import torch  # noqa: F401  (a rank has torch up before it loads: not part of the restore)

    from relaunch.train import CheckpointManager

    def made() -> CheckpointManager:
        peers = None if peer in ("storage", "local") else _peers(peer, mb)
        local = _local(directory) if peer == "local" else None
        return CheckpointManager(Path(directory) / "ckpt", rank=0, peers=peers, local=local)

    manager = None if late else made()
    model = _state(mb)
    manager = made() if manager is None else manager
    ready = manager.peers.ready if manager.peers is not None else None
    if together:
        if ready is not None:
            ready.wait(600)  # each as ready as a rank alone is (`ready_share`)
        _say(ready=True)
        sys.stdin.readline()
    faulted = ready.faulted if ready is not None else 0
    began = time.time()
    start = time.perf_counter()
    loaded = manager.load()
    took = time.perf_counter() - start
    assert loaded is not None and loaded.step == 1
    del model
    tier = manager.restored_from.get((0, 1), "storage")
    _say(seconds=took, tier=tier, ready_share=faulted / (mb << 20), began=began, ended=time.time())


SHARD = Path("ckpt") / "step-000000001" / "rank-0.ckpt"
"""The step the benchmark saves, rank 0's file: what the storage's raw read reads."""


def shared_read(server: FileServer, directory: str) -> None:
    """The shared storage's raw speed: a cold sequential read of the step's file through the
    mount, in the chunks the disk's raw read uses (relaunch_bench.checkpoint)."""
    with mounted(server, Path(directory)) as at:
        start = time.perf_counter()
        with open(at / SHARD, "rb") as f:
            while f.read(8 << 20):
                pass
        _say(seconds=time.perf_counter() - start)


def shared_restore(server: FileServer, directory: str, mb: int) -> None:
    with mounted(server, Path(directory)) as at:
        restore(str(at), "storage", mb)


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "keeper":
        keeper(args[0])
    elif command == "send":
        send(args[0], int(args[1]))
    elif command == "receive":
        receive(args[0], int(args[1]), int(args[2]))
    elif command == "save":
        stall = args[3].removeprefix("stall=") if len(args) > 3 else "0"
        save(args[0], int(args[1]), args[2], stall_pairs=int(stall))
    elif command == "copy-again":
        copy_again(args[0], int(args[1]), args[2])
    elif command == "restore":
        extra = args[3:]
        restore(
            args[0], args[1], int(args[2]), late=extra == ["late"], together=extra == ["together"]
        )
    elif command == "shared-read":
        shared_read(FileServer(args[0], Path(args[1])), args[2])
    elif command == "shared-restore":
        shared_restore(FileServer(args[0], Path(args[1])), args[2], int(args[3]))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
