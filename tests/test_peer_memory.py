"""Peer memory: a rank's checkpoint copied into another node's agent, and restored from there,
checked against the manifest on storage, with storage as the fallback for every way a copy can
be wrong (altered in memory, of another step, torn, lost with its node). Real sockets, real
shards, real torch state; the keeper is the one every agent runs (relaunch.cluster.keeper)."""

from __future__ import annotations

import json
import mmap
import os
import re
import signal
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relaunch.cluster import keeper
from relaunch.cluster.keeper import PeerMemory, PeerMemoryServer, StoredCopy
from relaunch.events import EventKind
from relaunch.protocol import peer_memory
from relaunch.protocol.environment import Env, PodEnvironment
from relaunch.protocol.peer_memory import ReadyMemory, parse_peers, send_header
from relaunch.train import CheckpointManager, CheckpointWarning
from relaunch.train.peer import PeerCopies
from tests.runtime import DDP_CLUSTER as CLUSTER
from tests.runtime import FSDP_SCRIPT, Cluster, Restore, ddp_job, final_hash, rank_logs

JOB = "7"


def copy(step: int, rank: int = 0, size: int = 10, job: str = JOB) -> StoredCopy:
    manifest = {"files": {f"rank-{rank}.ckpt": {"size": size, "xxh3_128": f"h{step}"}}}
    return StoredCopy(job, rank, step, manifest, bytearray(size))


def test_a_node_keeps_a_jobs_copies_within_its_budget_the_oldest_step_first() -> None:
    memory = PeerMemory()
    for step in (10, 20):
        for rank in (0, 1):
            assert memory.put(copy(step, rank), budget=40) is None
    assert memory.put(copy(5, job="other"), budget=10) is None  # another job's budget is its own
    assert memory.put(copy(30, 0), budget=40) is None  # step 10 goes whole, both ranks
    assert [(r, s) for r, s, _, _ in memory.index(JOB)] == [(0, 20), (0, 30), (1, 20)]
    assert "no room for step 15" in str(memory.put(copy(15, 1, size=20), budget=40))
    assert "more than the job's 40 bytes" in str(memory.put(copy(40, 0, size=41), budget=40))
    assert memory.put(copy(30, 0, size=20), budget=40) is None  # the same copy again replaces it
    assert [(r, s, n) for r, s, n, _ in memory.index(JOB)] == [
        (0, 20, 10),
        (0, 30, 20),
        (1, 20, 10),
    ]
    assert memory.index("other") == [(0, 5, 10, "h5")]


@pytest.fixture
def nodes() -> Iterator[dict[str, PeerMemoryServer]]:
    servers = {f"node-{i}": PeerMemoryServer("127.0.0.1").start() for i in range(3)}
    yield servers
    for server in servers.values():
        server.shutdown()
        server.server_close()


def peers_of(node: str, servers: dict[str, PeerMemoryServer], budget: int = 64 << 20) -> PeerCopies:
    return PeerCopies(JOB, node, {n: s.address for n, s in servers.items()}, budget)


def state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return {
        "model": model.state_dict(),
        "step_rng": torch.randint(0, 99, (4,), generator=generator),
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and torch.equal(
        a["step_rng"], b["step_rng"]
    )


def saved(
    directory: Path, servers: dict[str, PeerMemoryServer], steps: list[int]
) -> CheckpointManager:
    """Rank 0 on node-0 saves `steps` (state seeded by the step); its copies go to node-1."""
    manager = CheckpointManager(directory, rank=0, keep=3, peers=peers_of("node-0", servers))
    for step in steps:  # each copy sent before the next save (a waiting one would be replaced)
        manager.save(step, state(step))
        assert manager.peers is not None and manager.peers.wait(30)
    assert manager.peers is not None
    assert list(manager.peers.sent) == [(s, "node-1") for s in steps], manager.peers.failures
    return manager


def restorer(
    directory: Path, servers: dict[str, PeerMemoryServer], node: str = "node-2"
) -> CheckpointManager:
    """The rank replaced: a new process of rank 0, now on `node`, its memory for the copy made
    ready before it loads (as a rank's start gives it time to): every way a copy is refused is
    met in that memory, and the next tier serves."""
    manager = CheckpointManager(directory, rank=0, keep=3, peers=peers_of(node, servers))
    assert manager.peers is not None and manager.peers.ready is not None
    assert manager.peers.ready.wait(30)
    return manager


def test_a_replaced_rank_restores_from_a_peers_memory_without_storages_shard(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    saved(tmp_path, nodes, [10, 20])
    (tmp_path / "step-000000020" / "rank-0.ckpt").unlink()  # only the manifest is on storage
    manager = restorer(tmp_path, nodes)
    assert manager.verified_steps() == [20, 10]  # 20 counts: a peer holds it with its hash
    loaded = manager.load()
    assert loaded is not None and loaded.step == 20 and same(loaded.state, state(20))
    assert manager.restored_from == {(0, 20): "peer memory of node-1"}
    assert nodes["node-1"].memory.size() > 0 and nodes["node-2"].memory.size() == 0


def test_a_replaced_ranks_copy_lands_in_the_memory_made_ready_while_it_started(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    """The manager, made at the rank's start, maps and faults in memory of its newest copy's
    size; the restore receives into it (its tensors are views of it), and the state is whole."""
    saved(tmp_path, nodes, [10, 20])
    held = nodes["node-1"].memory.get(JOB, 0, 20)
    assert held is not None
    manager = restorer(tmp_path, nodes)
    assert manager.peers is not None
    ready = manager.peers.ready
    assert ready is not None and ready.held == ready.faulted == len(held.data)
    loaded = manager.load()
    assert loaded is not None and loaded.step == 20 and same(loaded.state, state(20))
    assert manager.restored_from == {(0, 20): "peer memory of node-1"}
    assert ready.taken and ready.held == 0 and manager.peers.ready is None


def test_a_first_start_finds_no_copy_and_holds_no_memory_for_one(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    manager = CheckpointManager(tmp_path, rank=0, peers=peers_of("node-0", nodes))
    assert manager.peers is not None and manager.peers.ready is not None
    assert manager.peers.ready.wait(30)
    assert manager.peers.ready.held == manager.peers.ready.faulted == 0
    assert manager.load() is None


@pytest.mark.parametrize("trains", ["saves", "steps-between-saves"])
def test_a_rank_that_trains_instead_of_restoring_lets_its_ready_memory_go(
    trains: str, tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    """A rank whose state came another way (a healthy replica's broadcast) trains on: its first
    save, or its first step between saves, lets the memory go."""
    saved(tmp_path, nodes, [10])
    manager = restorer(tmp_path, nodes, node="node-0")  # restarted in place, starts over
    manager.every = 10
    assert manager.peers is not None and manager.peers.ready is not None
    ready = manager.peers.ready
    assert ready.held > 0
    if trains == "saves":
        manager.save(20, state(20))
        assert manager.peers.wait(30) and (20, "node-1") in manager.peers.sent
    else:
        assert not manager.maybe_save(11, state(11))
    assert ready.held == 0 and not ready.taken and manager.peers.ready is None


def test_a_restore_that_comes_before_its_memory_is_ready_receives_into_fresh_memory() -> None:
    """The peers' answer still on its way when the copy is wanted: nothing is waited for, the
    copy gets fresh memory, and the late answer maps nothing."""
    answered, asked = threading.Event(), threading.Event()

    def size_of() -> int:
        asked.set()
        answered.wait(30)
        return 1 << 20

    ready = ReadyMemory(size_of)
    assert asked.wait(30)
    memory = ready.take(4096)
    assert len(memory) == 4096 and not ready.taken
    answered.set()
    assert ready.wait(30) and ready.held == ready.faulted == 0


def test_a_copy_wanted_while_its_memory_faults_in_takes_it_as_it_is_and_the_rest_on_arrival(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The restore comes after two chunks were faulted in: the faulting stops there (no byte is
    written under the copy's), and the copy takes the whole memory, its bytes all its own."""
    chunks: list[int] = []
    ready_box: list[ReadyMemory] = []
    boxed = threading.Event()
    real = peer_memory.fault_in

    def fault_in(view: Any) -> None:
        real(view)
        if not ready_box or threading.current_thread() is not ready_box[0]._thread:
            return  # an earlier test's memory, still faulting in on its own thread
        chunks.append(len(view))
        if len(chunks) == 2:
            ready_box[0]._stop.wait(30)  # the copy is wanted now

    monkeypatch.setattr(peer_memory, "fault_in", fault_in)
    size = 6 * peer_memory.FAULT_IN_CHUNK
    ready = ReadyMemory(lambda: size if boxed.wait(30) else 0)  # its first chunk once boxed
    ready_box.append(ready)
    boxed.set()
    while len(chunks) < 2:  # the second chunk faulted in, its thread waiting for the word
        ready.wait(0.01)
    memory = ready.take(size)
    assert ready.taken and len(memory) == size and ready.wait(30)
    assert ready.faulted == 2 * peer_memory.FAULT_IN_CHUNK and len(chunks) == 2
    data = os.urandom(size)
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=left.sendall, args=(data,))
        sender.start()
        peer_memory.receive_into(right, memory)
        sender.join()
    assert bytes(memory) == data


def test_memory_that_cannot_be_had_is_not_made_ready_and_the_copy_gets_fresh_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer's index that names a size this machine cannot map: the thread ends quietly."""
    raised: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    ready = ReadyMemory(lambda: 1 << 62)
    assert ready.wait(30) and ready.held == ready.faulted == 0 and not raised
    assert len(ready.take(4096)) == 4096 and not ready.taken


@pytest.mark.parametrize("how", ["populate", "written"])
@pytest.mark.parametrize("kind", ["mapped", "bytearray", "unaligned"])
def test_faulting_memory_in_leaves_every_byte_as_it_was(
    how: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "written":  # a kernel without MADV_POPULATE_WRITE: a byte a page, read and put back
        monkeypatch.setattr(peer_memory, "_populate", lambda: None)
    size = 3 * mmap.PAGESIZE + 123
    memory: Any = peer_memory.memory_for(size) if kind == "mapped" else bytearray(size)
    view = memoryview(memory)[1:] if kind == "unaligned" else memoryview(memory)
    pattern = os.urandom(len(view))
    view[:] = pattern
    peer_memory.fault_in(view)
    assert bytes(view) == pattern


def refused(manager: CheckpointManager, why: str) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = manager.load()
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert any(why in text and "node-1's memory was refused" in text for text in said), said
    assert loaded is not None and loaded.step == 20 and same(loaded.state, state(20))
    assert manager.restored_from == {(0, 20): "storage"}
    return loaded


def test_a_copy_altered_in_memory_by_one_byte_is_refused_and_storage_serves(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    saved(tmp_path, nodes, [10, 20])
    held = nodes["node-1"].memory.get(JOB, 0, 20)
    assert held is not None
    flips = {10: "header", len(held.data) // 2: "checksum", len(held.data) - 1: "checksum"}
    for where, why in flips.items():  # the header, a tensor, the pickled rest
        held.data[where] ^= 0x01
        refused(restorer(tmp_path, nodes), why)
        held.data[where] ^= 0x01


def test_a_copy_of_an_older_step_is_refused_and_storage_serves(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    saved(tmp_path, nodes, [10, 20])
    memory = nodes["node-1"].memory
    old = memory.get(JOB, 0, 10)
    assert old is not None
    memory.put(StoredCopy(JOB, 0, 20, old.manifest, old.data), budget=1 << 30)  # stale, as is
    refused(restorer(tmp_path, nodes), "not the one on storage")
    manifest = json.loads((tmp_path / "step-000000020" / "rank-0.manifest.json").read_text())
    size = manifest["files"]["rank-0.ckpt"]["size"]
    forged = bytearray(old.data[:size]) + bytes(max(0, size - len(old.data)))
    memory.put(StoredCopy(JOB, 0, 20, manifest, forged), budget=1 << 30)  # under step 20's manifest
    refused(restorer(tmp_path, nodes), "checksum")


def test_a_peer_memory_gone_bad_spoils_what_it_holds_and_what_comes_after(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    """The fault plan's `peer-copy-corrupt`, a failing memory module: node-1 flips one byte of
    each copy of the job it holds, and of each it receives after. A replaced rank refuses them
    (their checksum) and storage serves; another job's copies there stay whole."""
    manager = saved(tmp_path, nodes, [10])
    memory = nodes["node-1"].memory
    assert memory.put(copy(5, job="other"), budget=1 << 20) is None
    before = bytes(memory.get(JOB, 0, 10).data)  # type: ignore[union-attr]
    assert memory.go_bad(JOB) == 1
    assert bytes(memory.get(JOB, 0, 10).data) != before  # type: ignore[union-attr]
    manager.save(20, state(20))  # its copy arrives after the memory went bad
    assert manager.peers is not None and manager.peers.wait(30) and manager.peers.sent
    refused(restorer(tmp_path, nodes), "checksum")
    assert bytes(memory.get("other", 0, 5).data) == bytes(10)  # type: ignore[union-attr]


class _LostMidway(keeper._Handler):
    """A peer lost in the middle of a restore: it sends half the copy, then its connection ends."""

    def _answer(self, sock: socket.socket, header: dict[str, Any]) -> None:
        found = self.server.memory.get(
            JOB, int(header.get("rank", -1)), int(header.get("step", -1))
        )
        if header.get("op") != "get" or found is None:
            super()._answer(sock, header)
            return
        send_header(sock, {"ok": True, "size": len(found.data), "manifest": found.manifest})
        sock.sendall(found.data[: len(found.data) // 2])


def test_a_peer_lost_during_the_restore_falls_back_to_storage(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    saved(tmp_path, nodes, [10, 20])
    nodes["node-1"].RequestHandlerClass = _LostMidway
    refused(restorer(tmp_path, nodes), "still to come")
    nodes["node-1"].shutdown()
    nodes["node-1"].server_close()  # and now gone: nothing listens there
    refused_quietly = restorer(tmp_path, nodes)
    loaded = refused_quietly.load()
    assert loaded is not None and same(loaded.state, state(20))
    assert refused_quietly.restored_from == {(0, 20): "storage"}


def test_a_copy_torn_on_its_way_to_the_peer_is_never_kept(
    nodes: dict[str, PeerMemoryServer],
) -> None:
    server = nodes["node-1"]
    with socket.create_connection(server.address) as sock:
        send_header(
            sock,
            {
                "op": "put",
                "job": JOB,
                "rank": 0,
                "step": 5,
                "manifest": {},
                "size": 1000,
                "budget": 1 << 20,
            },
        )
        sock.sendall(bytes(400))
    with socket.create_connection(server.address) as sock:  # the server has read the rest by now
        send_header(sock, {"op": "index", "job": JOB})
        from relaunch.protocol.peer_memory import read_header

        assert read_header(sock) == {"ok": True, "copies": []}


class _AllAtOnce(keeper._Handler):
    """A keeper that begins no put and answers no get until `together` of them are under way
    at once: one that served a connection at a time would keep the others waiting for ever."""

    together: threading.Barrier

    def _answer(self, sock: socket.socket, header: dict[str, Any]) -> None:
        if header.get("op") in ("put", "get"):
            self.together.wait(timeout=30)  # broken: the transfer ends, and the test with it
        super()._answer(sock, header)


def test_a_pods_ranks_restore_at_once_from_one_peer_while_another_rank_copies_to_it(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    """A lost node's pod of four ranks starts afresh on node-2, and its ranks restore at once
    from node-1, which holds all four copies, while a rank still on node-0 copies its next step
    there: the keeper serves the four gets and the put together (it answers none until all five
    are under way), and each rank gets its own state bit for bit, from peer memory (storage's
    shards are gone)."""
    ranks = range(4)
    for rank in ranks:
        manager = CheckpointManager(tmp_path, rank=rank, peers=peers_of("node-0", nodes))
        manager.save(10, state(rank))
        assert manager.peers is not None and manager.peers.wait(30)
        assert list(manager.peers.sent) == [(10, "node-1")], manager.peers.failures
    for rank in ranks:
        (tmp_path / "step-000000010" / f"rank-{rank}.ckpt").unlink()
    copying = CheckpointManager(tmp_path, rank=4, peers=peers_of("node-0", nodes))
    moved = [
        CheckpointManager(tmp_path, rank=rank, peers=peers_of("node-2", nodes)) for rank in ranks
    ]
    assert all(m.peers is not None and m.peers.ready and m.peers.ready.wait(30) for m in moved)
    _AllAtOnce.together = threading.Barrier(len(moved) + 1)
    nodes["node-1"].RequestHandlerClass = _AllAtOnce
    loaded: dict[int, Any] = {}
    loads = [threading.Thread(target=lambda m=m: loaded.update({m.rank: m.load()})) for m in moved]
    for thread in loads:
        thread.start()
    copying.save(20, state(4))
    assert copying.peers is not None and copying.peers.wait(60)
    for thread in loads:
        thread.join(60)
    assert list(copying.peers.sent) == [(20, "node-1")], copying.peers.failures
    assert not _AllAtOnce.together.broken
    for manager in moved:
        checkpoint = loaded[manager.rank]
        assert checkpoint is not None and checkpoint.step == 10
        assert same(checkpoint.state, state(manager.rank))
        assert manager.restored_from == {(manager.rank, 10): "peer memory of node-1"}
    assert [(r, s) for r, s, _, _ in nodes["node-1"].memory.index(JOB)] == [
        *((rank, 10) for rank in ranks), (4, 20),
    ]  # fmt: skip


def test_no_node_holds_both_a_ranks_state_and_its_only_copy(
    nodes: dict[str, PeerMemoryServer],
) -> None:
    assert [peers_of(n, nodes).target() for n in sorted(nodes)] == ["node-1", "node-2", "node-0"]
    alone = PeerCopies(JOB, "node-0", {"node-0": nodes["node-0"].address}, 1 << 20)
    assert alone.target() is None


def test_a_copy_whose_target_node_is_gone_goes_to_the_next_node_and_is_restored_from_there(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    """Rank 0 on node-0 copies to node-1; node-1 is lost (its memory answers no more), as a
    healthy rank saves its dying gasp: the copy goes to node-2 instead, the next node round the
    ring, and later copies go there first without waiting on node-1 again. A rank replaced on
    node-1's successor restores the gasp's step from node-2's memory, not from storage."""
    manager = CheckpointManager(tmp_path, rank=0, keep=3, peers=peers_of("node-0", nodes))
    assert manager.peers is not None
    manager.save(10, state(10))
    assert manager.peers.wait(30) and list(manager.peers.sent) == [(10, "node-1")]
    nodes["node-1"].shutdown()
    nodes["node-1"].server_close()  # its address refuses connections: the node is gone
    for step in (20, 30):
        manager.save(step, state(step))
        assert manager.peers.wait(30)
    assert list(manager.peers.sent) == [(10, "node-1"), (20, "node-2"), (30, "node-2")]
    assert manager.peers.unreachable == {"node-1"}
    assert manager.peers.candidates() == ["node-2", "node-1"]
    (tmp_path / "step-000000030" / "rank-0.ckpt").unlink()  # storage no longer has its bytes
    replaced = restorer(tmp_path, {n: s for n, s in nodes.items() if n != "node-1"}, "node-3")
    loaded = replaced.load()
    assert loaded is not None and loaded.step == 30 and same(loaded.state, state(30))
    assert replaced.restored_from == {(0, 30): "peer memory of node-2"}


def test_a_job_without_peer_memory_copies_nothing_and_its_ranks_are_told_where_the_peers_are(
    tmp_path: Path,
) -> None:
    pod = PodEnvironment(pod=1, node="node-1", generation=1, schedule_cnt=1, proc_start_cnt=1)
    assert Env.PEER_MEMORY not in pod.variables({})
    told = PodEnvironment(
        pod=1,
        node="node-1",
        generation=1,
        schedule_cnt=1,
        proc_start_cnt=1,
        peer_memory="node-0=10.1.0.2:4000,node-1=10.1.0.3:4001",
        peer_memory_bytes=1 << 20,
    ).variables({Env.JOB_ID: JOB})
    peers = PeerCopies.from_env(told)
    assert peers is not None and peers.target() == "node-0" and peers.budget == 1 << 20
    assert parse_peers(told[Env.PEER_MEMORY]) == {
        "node-0": ("10.1.0.2", 4000),
        "node-1": ("10.1.0.3", 4001),
    }
    assert PeerCopies.from_env({Env.JOB_ID: JOB}) is None
    assert CheckpointManager(tmp_path).peers is None


def test_a_lost_nodes_pod_restores_from_peer_memory_and_ends_bit_identical(
    cluster: Cluster, unbroken: str
) -> None:
    """The DDP example, unchanged, with `peer_memory_mb`: node-0 is lost at step 75 with pod 0 on
    it, and the job is rebuilt on healthy nodes. Rank 1 (node-1) saves its dying gasp to storage
    and its copy to node-2's memory, the node after its own, and restores from there. Rank 0's
    copies went to node-1's memory: the newest of them made it there unless node-0 died while it
    was on its way; either way rank 0 restores from a peer's memory (its own copy, else rank 1's:
    the state is replicated), never from storage, and the record says which. The parameters end
    bit for bit as the unbroken run's."""
    out = cluster.dir / "hash.txt"
    job = ddp_job(out, 10)
    job["spec"]["peer_memory_mb"] = 16
    faults = [{"kind": "node-down", "at_step": 75, "pod": 0}]
    result = cluster.run(job, faults, CLUSTER, timeout=300, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["isolated-job-reschedule"]  # pod 0 holds rank 0
    restores = sorted(result.restores())
    assert len(restores) == 2, restores
    step = restores[0].step
    assert step >= 70, restores
    assert restores[0] in (
        Restore(0, 0, step, "peer-memory", "node-1"),
        Restore(0, 0, step, "peer-memory", "node-2"),
    ), restores
    assert restores[1] == Restore(1, 1, step, "peer-memory", "node-2")
    assert out.read_text().strip() == unbroken


def test_a_peer_memory_gone_bad_is_refused_while_the_controller_is_away_and_put_on_record(
    cluster: Cluster, unbroken: str
) -> None:
    """Issue 48's altered copy end to end, in the agents' own memory, at the joint with a
    controller outage. The DDP example as one pod of two ranks, whose copies go to node-1's
    memory. The fault plan makes node-1's memory go bad at step 30 (`peer-copy-corrupt`: one
    byte of every copy of the job flipped there, and of every later one), then loses the pod's
    node at step 75, and the controller is killed the moment it has started the rebuilt pod
    (failpoint `starting`). Step 80's save is held 5 s, so that the node goes before it: the
    newest step is 70, whose copies node-1 holds (beside a CPU hog, the node went after step
    80 was on storage but before its copies were sent, and storage served it without a copy to
    refuse). Both ranks find their copies in node-1's memory, refuse them (their
    checksum, said in their output) and restore from storage while no controller is there; the
    test waits for that before it resumes the controller. The launcher keeps what the ranks said
    of their restore, and the resumed controller records it: one record, each rank's restore
    from storage, the parameters bit for bit the unbroken run's (world size 2 either way)."""
    out = cluster.dir / "hash.txt"
    job = ddp_job(out, 10, extra="--slow-save-at 80 --slow-save-s 5")
    job["spec"].update(replicas=1, procs_per_pod=2, peer_memory_mb=16)
    faults = [
        {"kind": "peer-copy-corrupt", "at_step": 30, "node": "node-1"},
        {"kind": "node-down", "at_step": 75, "pod": 0},
    ]
    command = cluster.command(job, faults, {**CLUSTER, "adopt_grace_s": 60}, startup_s=60)
    env = {**os.environ, Env.FAILPOINT: "starting"}
    killed = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    logs = cluster.state / "jobs" / "1" / "pods" / "pod-0-g2" / "logs"
    deadline = time.monotonic() + 60
    while rank_logs(logs).count("resume_step=") < 2:  # after each rank's restore
        assert time.monotonic() < deadline, rank_logs(logs)
        time.sleep(0.1)
    result = cluster.resume()
    assert result.returncode == 0, result.stdout + result.stderr
    assert [e["state"] for e in result.report["fault_plan"]] == ["fired", "fired"]
    # pod 0 holds rank 0: the job is rebuilt without the node
    assert result.actions == ["isolated-job-reschedule"], result.report["recoveries"]
    restores = sorted(result.restores())
    assert restores == [Restore(0, rank, 70, "storage", "") for rank in (0, 1)], result.events()
    refusals = re.findall(r"the copy in node-1's memory was refused: [^\n]*", result.logs())
    assert refusals and all("checksum" in r for r in refusals), refusals
    assert out.read_text().strip() == unbroken


def test_fsdp2_restores_its_shards_from_peer_memory_through_a_lost_node_bit_identical(
    cluster: Cluster, fsdp_unbroken: str
) -> None:
    """The FSDP2 example, unchanged (DCP checkpoints through ShardedCheckpointManager), with
    `peer_memory_mb`: node-0 is lost with pod 0 (rank 0) on it, and the job is rebuilt on
    healthy nodes. Each rank's own DCP file of the newest committed step was copied to the node
    after its own: rank 1's to node-2 (on record: it restored from there), rank 0's to node-1
    (from there too, unless node-0 died before the copy left it: then storage). DCP reads each
    rank's file from memory, the rest from storage, and the parameters end bit for bit as the
    fault-free run's under torchrun."""
    job = {
        "kind": "job",
        "metadata": {
            "name": "fsdp",
            "annotations": {"fault-tolerance/job-retry-num": "3", "fault-tolerance/pod-retry-num": "2"},
            "labels": {"fault-scheduling": "grace", "grace-over-time": "10"},
        },
        "spec": {
            "replicas": 2, "procs_per_pod": 1, "chips_per_pod": 2, "monitor_interval": 0.2,
            # steps of 0.2 s, saves every 10: node-0 dies 1.6 s before step 30's save. Saves
            # every 5 and a fault at step 26 raced step 30's: CI at 0.05 s a step, and at 0.2 s
            # beside a CPU hog and a disk writer (the fault heard 4 steps late), saw step 30
            # committed as node-0 died, rank 1's copy of it never made, and both ranks rightly
            # take step 30 from storage
            "command": f"python {FSDP_SCRIPT} --steps 45 --step-seconds 0.2 --ckpt-every 10",
            "peer_memory_mb": 16,
        },
    }  # fmt: skip
    result = cluster.run(
        job, [{"kind": "node-down", "at_step": 22, "pod": 0}], CLUSTER, timeout=300, startup_s=60
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.actions == ["isolated-job-reschedule"]
    restores = sorted(result.restores())
    assert len(restores) == 2, restores
    step = restores[0].step
    assert step == 20, f"the fault came after step 30's save (heard late?): {restores}"
    assert restores[1] == Restore(1, 1, step, "peer-memory", "node-2"), restores
    assert restores[0] in (
        Restore(0, 0, step, "peer-memory", "node-1"),
        Restore(0, 0, step, "storage", ""),
    ), restores
    assert final_hash(result.logs()) == fsdp_unbroken


@pytest.mark.parametrize(
    ("warm_spares", "local"), [(0, False), (1, True)], ids=["plain", "spare-and-local-disk"]
)
def test_fsdp2_process_reschedule_keeps_the_healthy_rank_and_takes_the_moved_shard_from_peer_memory(
    cluster: Cluster, fsdp_unbroken: str, warm_spares: int, local: bool
) -> None:
    """The FSDP2 example under process-level recovery (`--process-recovery`: ShardedGroupKeeper)
    with `peer_memory_mb`: node-1 is lost with pod 1 (rank 1) on it; the controller moves that pod
    alone (process-reschedule) and rank 0 keeps its process. Shards have no replica, so both
    ranks build the model anew on the re-formed group and load the newest checkpoint: rank 1's
    shard from node-2's memory, where its copies went (the node after its own), rank 0's from
    storage (its copies were in node-1's memory, lost with it). The parameters end bit for bit
    as the fault-free run's under torchrun. The second run has a warm spare and a local
    checkpoint directory: the standby node's launcher and its spare (torch imported) become the
    moved pod and its rank, and rank 0, which kept its node, reads its shard from that node's
    disk instead of storage; the moved rank still from node-2's memory (the local disk comes
    after a peer's memory, and a moved rank's node holds no copy of it). The same ending."""
    job = {
        "kind": "job",
        "metadata": {
            "name": "fsdp-process",
            "annotations": {
                "fault-tolerance/job-retry-num": "3", "fault-tolerance/pod-retry-num": "2",
                "recover-strategy": "retry,recover-in-place,recover,dump,exit",
            },
            "labels": {"fault-scheduling": "grace", "grace-over-time": "5",
                       "process-recover-enable": "on", "pod-rescheduling": "on"},
        },
        "spec": {
            "replicas": 2, "procs_per_pod": 1, "chips_per_pod": 2, "monitor_interval": 0.2,
            "hang_detect_seconds": 4,
            "command": (  # saves every 10, the fault at 22: see the test above
                f"python {FSDP_SCRIPT} --process-recovery --steps 45 --step-seconds 0.2 "
                "--ckpt-every 10"
            ),
            "peer_memory_mb": 16, "warm_spares": warm_spares,
        },
    }  # fmt: skip
    if warm_spares:  # the spare, not a ready template, takes the moved rank (rank_source)
        job["spec"]["env"] = {"RELAUNCH_RANK_TEMPLATE": "0"}
    if local:
        job["spec"]["local_checkpoint_dir"] = str(cluster.dir / "node-disks")
    result = cluster.run(
        job, [{"kind": "node-down", "at_step": 22, "pod": 1}], CLUSTER, timeout=300, startup_s=60
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.actions == ["process-reschedule"], result.stdout[-3000:]
    took = [(e.fields["pod"], e.fields["node"]) for e in result.said(EventKind.STANDBY_TAKEN)]
    took_spare = (1, "node-2") in took
    assert took_spare == bool(warm_spares), result.stdout[-3000:]
    moved = (cluster.state / "jobs" / "1" / "pods" / "pod-1-g2" / "logs" / "rank-1.log").read_text()
    spare = re.findall(r"warm spare pid (\d+) ---", moved)
    started = re.findall(r"start: rank 1/2 pid=(\d+)", moved)
    assert spare == (started if warm_spares else []), moved[-2000:]  # the spare became rank 1
    found = re.findall(r"start: rank (\d)/2 pid=(\d+) resume_step=(\d+)", result.logs())
    assert sorted(rank for rank, _, _ in found) == ["0", "1", "1"], found  # rank 0: one process
    kept = [line for line in result.logs().splitlines() if "[relaunch] rank 0: rejoin" in line]
    assert len(kept) == 1, kept
    restores = sorted(result.restores())
    assert len(restores) == 2, restores
    step = restores[0].step
    assert step == 20, f"the fault came after step 30's save (heard late?): {restores}"
    assert restores == [
        Restore(0, 0, step, *(("local-disk", "node-0") if local else ("storage", ""))),
        Restore(1, 1, step, "peer-memory", "node-2"),
    ], restores
    assert final_hash(result.logs()) == fsdp_unbroken
    if local:  # the job ended: every agent removed its node's copies; node-1's died with it
        disks = cluster.dir / "node-disks"
        assert sorted(p.relative_to(disks).parts[:2] for p in disks.rglob("*.distcp")) == [
            ("node-1", "job-1")
        ] * len(list(disks.rglob("*.distcp")))
        assert sorted(p.name for p in disks.iterdir()) == ["node-1"]


def fsdp2_elastic_job(steps: int = 45) -> dict[str, Any]:
    """The FSDP2 example under process-level recovery with elastic training on."""
    from tests.test_process_recovery import ELASTIC

    return {
        "kind": "job",
        "metadata": {
            "name": "fsdp-elastic",
            "annotations": {"fault-tolerance/job-retry-num": "3",
                            "fault-tolerance/pod-retry-num": "2", "recover-strategy": ELASTIC},
            "labels": {"fault-scheduling": "grace", "grace-over-time": "5",
                       "process-recover-enable": "on", "pod-rescheduling": "on"},
        },
        "spec": {
            "replicas": 2, "procs_per_pod": 1, "chips_per_pod": 2, "monitor_interval": 0.2,
            "hang_detect_seconds": 4, "peer_memory_mb": 16,
            "command": (  # saves every 10, the fault at 22: see the lost-node test above
                f"python {FSDP_SCRIPT} --process-recovery --steps {steps} --step-seconds 0.2 "
                "--ckpt-every 10"
            ),
        },
    }  # fmt: skip


LOSE_POD_1 = [{"kind": "node-down", "at_step": 22, "pod": 1}]


def fsdp2_scaled_in(cluster: Cluster, local: bool) -> tuple[str, list[Restore], str]:
    """The FSDP2 job through a lost node with no standby (elastic training): its final hash,
    the restores on record, its logs. `local`: each rank's file also copied to its node's disk
    (`local_checkpoint_dir`), which the job's end empties but for the lost node's copies."""
    from tests.test_process_recovery import ELASTIC_CLUSTER, elastic_cluster

    elastic_cluster(cluster)
    job = fsdp2_elastic_job()
    disks = cluster.dir / "node-disks"
    if local:
        job["spec"]["local_checkpoint_dir"] = str(disks)
    result = cluster.run(job, LOSE_POD_1, ELASTIC_CLUSTER, timeout=300, startup_s=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.actions == ["scale-in"], result.stdout[-3000:]
    restores = sorted(result.restores())
    if local:
        left = {p.relative_to(disks).parts[:2] for p in disks.rglob("*.distcp")}
        assert left == {("node-1", "job-1")}, left  # node-1's agent was lost with it
    return final_hash(result.logs()), restores, result.logs()


def test_r33_fsdp2_scales_in_by_resharding_its_checkpoint_the_same_way_twice(
    tmp_path: Path, fsdp_unbroken: str
) -> None:
    """Elastic training on sharded state: node-1 is lost with pod 1 and no node stands by, so
    the job goes on with rank 0 alone (scale-in, R-33). Rank 0 keeps its process, builds the
    model anew on a group of one and loads step 20, which DCP reshards from the two ranks' files
    onto one. The checkpoint is the boundary, so two runs side by side end with the same
    parameters; one rank computing the whole batch sums in another order than two, so the hash
    is not the fault-free run's (which shows the scale-in did take effect). The second run keeps
    copies on each node's disk too: rank 0 takes its own file from node-0's disk and rank 1's,
    whose copy was lost with node-1, from storage, and the reshard gives the same bits."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        clusters = [Cluster(tmp_path / n) for n in ("a", "b")]
        runs = list(pool.map(fsdp2_scaled_in, clusters, [False, True]))
    tiers = [("storage", ""), ("local-disk", "node-0")]
    for (_, restores, logs), tier in zip(runs, tiers, strict=True):
        found = re.findall(r"start: rank (\d)/2 pid=(\d+) resume_step=(\d+)", logs)
        assert sorted(rank for rank, _, _ in found) == ["0", "1"], found  # rank 0: one process
        assert re.findall(r"rank 0: rejoin at step \d+, generation 2, now rank 0 of 1", logs)
        assert restores == [Restore(0, 0, 20, *tier)], restores
    assert runs[0][0] == runs[1][0]
    assert runs[0][0] != fsdp_unbroken


def test_r33_fsdp2_scales_out_when_the_node_comes_back_and_both_ranks_reload(
    cluster: Cluster,
) -> None:
    """After the scale-in, node-2 is released: pod 1 comes back there (scale-out), a new rank 1
    joins, and the group grows to 2 again. Rank 0 keeps its process, builds anew on the larger
    group and goes back to the newest checkpoint with the newcomer, DCP resharding it from one
    rank's file onto two; the job ends."""
    from tests.test_process_recovery import elastic_cluster, scale_in_then_release

    elastic_cluster(cluster)
    result = scale_in_then_release(cluster, fsdp2_elastic_job(steps=150), LOSE_POD_1)
    assert result.actions == ["scale-in"]
    assert [(e.fields["pod"], e.fields["node"]) for e in result.said(EventKind.SCALED_OUT)] == [
        (1, "node-2")
    ]
    logs = result.logs()
    found = re.findall(r"start: rank (\d)/2 pid=(\d+) resume_step=(\d+)", logs)
    assert sorted(rank for rank, _, _ in found) == ["0", "1", "1"], found  # rank 0: one process
    assert re.findall(r"rank 0: rejoin at step \d+, generation 2, now rank 0 of 1", logs)
    assert re.findall(r"rank 0: rejoin at step \d+, generation 3, now rank 0 of 2", logs)
    restores = result.restores()
    assert len(restores) == 3, restores  # rank 0 at the scale-in; both ranks at the scale-out
    assert restores[0] == Restore(0, 0, 20, "storage", ""), restores
    # both at the newest checkpoint when node-2 came back: step 20 (the two ranks' files, rank
    # 1's copy still in node-2's memory) or a later one rank 0 saved alone (its copy in node-2's
    # memory if it got there first; the newcomer's part resharded from rank 0's file: storage)
    grown = restores[1:]
    assert sorted((r.pod, r.rank) for r in grown) == [(0, 0), (1, 1)], restores
    assert all((r.tier, r.holder) in {("storage", ""), ("peer-memory", "node-2")} for r in grown)
    assert len({r.step for r in grown}) == 1 and grown[0].step % 10 == 0, restores
    final_hash(logs)


def test_a_sharded_ranks_own_file_comes_from_peer_memory_and_an_altered_one_from_storage(
    world_of_one: None, tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    """DCP checkpoints (ShardedCheckpointManager): rank 0's own file is copied to node-1; a new
    rank 0 on node-2 loads step 5 with that file gone from storage (memory served it), then step
    6 whose copy was altered in memory (refused, storage served it)."""
    from relaunch.train.sharded import ShardedCheckpointManager

    generator = torch.Generator().manual_seed(5)
    saved = {5: torch.randn(4096, generator=generator), 6: torch.randn(4096, generator=generator)}
    manager = ShardedCheckpointManager(tmp_path, keep=3, peers=peers_of("node-0", nodes))
    for step, tensor in saved.items():
        manager.save(step, {"w": tensor, "step": step})
        assert manager.peers is not None and manager.peers.wait(30)
    assert manager.peers is not None and [s for s, _ in manager.peers.sent] == [5, 6]
    restorer = ShardedCheckpointManager(tmp_path, peers=peers_of("node-2", nodes))
    (tmp_path / "step-000000005" / "__0_0.distcp").unlink()  # step 5's data: only in memory
    into = {"w": torch.zeros(4096), "step": 0}
    assert restorer.load(5, into=into) is not None
    assert torch.equal(into["w"], saved[5]) and into["step"] == 5
    held = nodes["node-1"].memory.get(JOB, 0, 6)
    assert held is not None
    held.data[len(held.data) // 2] ^= 0x10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert restorer.load(into=into) is not None
    assert torch.equal(into["w"], saved[6]) and into["step"] == 6
    assert any("node-1's memory was refused" in str(w.message) for w in caught)
    assert restorer.restored_from == {(0, 5): "peer memory of node-1", (0, 6): "storage"}


def test_a_copy_larger_than_the_budget_is_refused_before_its_bytes_are_taken(
    nodes: dict[str, PeerMemoryServer],
) -> None:
    from relaunch.protocol.peer_memory import read_header

    with socket.create_connection(nodes["node-1"].address) as sock:
        header = {"op": "put", "job": JOB, "rank": 0, "step": 5, "manifest": {}}
        send_header(sock, {**header, "size": 1 << 40, "budget": 1 << 20})  # no byte follows
        answer = read_header(sock)
    assert answer == {"ok": False, "error": f"{1 << 40} bytes: not within {1 << 20}"}
    assert nodes["node-1"].memory.size() == 0


def test_a_sharded_keeper_under_process_level_recovery_asks_for_its_checkpoint_and_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ShardedGroupKeeper re-forms a group by reloading a checkpoint: `run` without the
    ShardedCheckpointManager or without `resume` is refused before any step, saying what is
    missing (a plain CheckpointManager has no `regroup`)."""
    from relaunch.train.sharded_group import ShardedGroupKeeper

    monkeypatch.setenv(Env.MEMBERSHIP, str(tmp_path / "membership.json"))
    keeper = ShardedGroupKeeper(lambda: (torch.nn.Linear(1, 1), None))  # type: ignore[arg-type,return-value]
    ran: list[int] = []
    regroups = type("Regroups", (CheckpointManager,), {"regroup": lambda self: None})
    for checkpoint, resume in [
        (None, lambda: 0),
        (CheckpointManager(tmp_path), lambda: 0),
        (regroups(tmp_path), None),
    ]:
        with pytest.raises(TypeError, match="ShardedCheckpointManager and resume="):
            keeper.run(1, 2, ran.append, checkpoint=checkpoint, resume=resume)
    assert ran == []
