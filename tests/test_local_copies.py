"""The local-disk tier (relaunch.train.local): each rank's checkpoint also copied onto its node's
own disk, and read back from there by a rank that restarts on that node, checked against the
manifest on storage, with storage as the fallback for every way a copy can be wrong (altered,
torn, of an older save of the step) and for a rank that moved to another node. Real files, real
shards, real torch state; the peers are the keepers every agent runs."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from relaunch.cluster.keeper import PeerMemoryServer
from relaunch.errors import SpecError
from relaunch.protocol.environment import Env, PodEnvironment
from relaunch.protocol.messages import AgentHello, ForgetCopies, Heartbeat, Shutdown
from relaunch.protocol.wire import Connection
from relaunch.train import CheckpointManager, CheckpointWarning
from relaunch.train.local import LocalCopies, forget_job, job_root
from relaunch.train.peer import PeerCopies
from tests.builders import AUTO, job
from tests.test_peer_memory import JOB, nodes, peers_of, same, state

__all__ = ["nodes"]  # the fixture, for this file's tests


def local_of(tmp_path: Path, node: str, keep: int = 2) -> LocalCopies:
    """The copies of job JOB on `node`'s disk, as a rank there finds them from its environment."""
    environ = {Env.LOCAL_CHECKPOINTS: str(tmp_path / "local"), Env.JOB_ID: JOB, Env.NODE: node}
    local = LocalCopies.from_env(keep, environ)
    assert local is not None
    return local


def saved(tmp_path: Path, steps: list[int], **kwargs: Any) -> CheckpointManager:
    """Rank 0 on node-0 saves `steps` (state seeded by the step), keeping 2 on storage."""
    storage = tmp_path / "storage"
    manager = CheckpointManager(
        storage, rank=0, keep=2, local=local_of(tmp_path, "node-0"), **kwargs
    )
    for step in steps:  # each copy made before the next save (a waiting one would be replaced)
        manager.save(step, state(step))
        assert manager.local is not None and manager.local.wait(30)
    assert manager.local is not None and not manager.local.failures, manager.local.failures
    return manager


def restarted(tmp_path: Path, node: str = "node-0", **kwargs: Any) -> CheckpointManager:
    """Rank 0 started again, on `node`."""
    return CheckpointManager(
        tmp_path / "storage", rank=0, keep=2, local=local_of(tmp_path, node), **kwargs
    )


def local_file(tmp_path: Path, step: int, node: str = "node-0") -> Path:
    return local_of(tmp_path, node).path(step, "rank-0.ckpt")


def loaded_with(manager: CheckpointManager) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = manager.load()
    return loaded, [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


def test_a_rank_restarted_on_its_node_restores_from_its_local_disk_without_storages_shard(
    tmp_path: Path,
) -> None:
    saved(tmp_path, [10, 20, 30])
    copies = sorted(p.relative_to(tmp_path) for p in (tmp_path / "local").rglob("*") if p.is_file())
    assert copies == [  # bounded as storage is: the newest 2 steps
        Path(f"local/node-0/job-{JOB}/step-000000020/rank-0.ckpt"),
        Path(f"local/node-0/job-{JOB}/step-000000030/rank-0.ckpt"),
    ]
    shard = tmp_path / "storage" / "step-000000030" / "rank-0.ckpt"
    assert local_file(tmp_path, 30).read_bytes() == shard.read_bytes()
    shard.unlink()  # only the manifest is on storage: the bytes can only come from the local disk
    manager = restarted(tmp_path)
    loaded, said = loaded_with(manager)
    assert said == [] and loaded is not None and loaded.step == 30
    assert same(loaded.state, state(30))
    assert manager.restored_from == {(0, 30): "local disk of node-0"}


def refused_locally(tmp_path: Path, why: str, expect: dict[str, Any] | None = None) -> None:
    manager = restarted(tmp_path)
    loaded, said = loaded_with(manager)
    assert any(why in text and "node-0's local disk was refused" in text for text in said), said
    assert loaded is not None and loaded.step == 30
    assert same(loaded.state, expect if expect is not None else state(30))
    assert manager.restored_from == {(0, 30): "storage"}


def test_a_local_copy_altered_by_one_byte_is_refused_and_storage_serves(tmp_path: Path) -> None:
    saved(tmp_path, [20, 30])
    path = local_file(tmp_path, 30)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    refused_locally(tmp_path, "checksum")


def test_a_torn_local_copy_is_refused_and_storage_serves(tmp_path: Path) -> None:
    saved(tmp_path, [20, 30])
    path = local_file(tmp_path, 30)
    path.write_bytes(path.read_bytes()[:-100])  # a crash in the middle of the copy
    refused_locally(tmp_path, "bytes where the manifest says")


def test_a_local_copy_of_an_older_save_of_the_step_is_refused_and_storage_serves(
    tmp_path: Path,
) -> None:
    """Step 30 saved, then saved again with other state (a job-level restart that went back
    past it and trained it again): the node's copy of the first save is put back in place of
    the second's, as a copy left by a process of the earlier attempt would be."""
    manager = saved(tmp_path, [20, 30])
    older = tmp_path / "older.ckpt"
    shutil.copyfile(local_file(tmp_path, 30), older)
    manager.save(30, state(31))
    assert manager.local is not None and manager.local.wait(30)
    shutil.copyfile(older, local_file(tmp_path, 30))
    refused_locally(tmp_path, "checksum", expect=state(31))


def test_a_rank_moved_to_another_node_finds_no_local_copy_there_and_reads_storage(
    tmp_path: Path,
) -> None:
    saved(tmp_path, [20, 30])
    manager = restarted(tmp_path, node="node-1")
    loaded, said = loaded_with(manager)
    assert said == []  # nothing there to refuse
    assert loaded is not None and loaded.step == 30 and same(loaded.state, state(30))
    assert manager.restored_from == {(0, 30): "storage"}


def test_peer_memory_serves_first_and_the_local_disk_serves_a_refused_peer_copy(
    tmp_path: Path, nodes: dict[str, PeerMemoryServer]
) -> None:
    manager = saved(tmp_path, [20, 30], peers=peers_of("node-0", nodes))
    assert manager.peers is not None and manager.peers.wait(30)
    first = restarted(tmp_path, peers=peers_of("node-0", nodes))
    assert (loaded := first.load()) is not None and same(loaded.state, state(30))
    assert first.restored_from == {(0, 30): "peer memory of node-1"}
    held = nodes["node-1"].memory.get(JOB, 0, 30)
    assert held is not None
    held.data[len(held.data) // 3] ^= 0x40
    second = restarted(tmp_path, peers=peers_of("node-0", nodes))
    loaded, said = loaded_with(second)
    assert any("node-1's memory was refused" in text for text in said), said
    assert loaded is not None and loaded.step == 30 and same(loaded.state, state(30))
    assert second.restored_from == {(0, 30): "local disk of node-0"}


def test_a_sharded_ranks_own_file_comes_from_its_local_disk_and_an_altered_one_from_storage(
    world_of_one: None, tmp_path: Path
) -> None:
    from relaunch.train.sharded import ShardedCheckpointManager

    generator = torch.Generator().manual_seed(5)
    tensors = {5: torch.randn(4096, generator=generator), 6: torch.randn(4096, generator=generator)}
    local = local_of(tmp_path, "node-0", keep=3)
    manager = ShardedCheckpointManager(tmp_path / "storage", keep=3, local=local)
    for step, tensor in tensors.items():
        manager.save(step, {"w": tensor, "step": step})
        assert local.wait(30) and not local.failures, local.failures
    restorer = ShardedCheckpointManager(tmp_path / "storage", local=local_of(tmp_path, "node-0"))
    (tmp_path / "storage" / "step-000000005" / "__0_0.distcp").unlink()  # only on the node's disk
    into = {"w": torch.zeros(4096), "step": 0}
    assert restorer.load(5, into=into) is not None
    assert torch.equal(into["w"], tensors[5]) and into["step"] == 5
    path = local.path(6, "__0_0.distcp")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x02
    path.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert restorer.load(into=into) is not None
    assert torch.equal(into["w"], tensors[6]) and into["step"] == 6
    assert any("node-0's local disk was refused" in str(w.message) for w in caught)
    assert restorer.restored_from == {(0, 5): "local disk of node-0", (0, 6): "storage"}


def test_a_job_without_a_local_checkpoint_dir_copies_nothing_and_its_ranks_are_told_the_dir(
    tmp_path: Path,
) -> None:
    pod = PodEnvironment(pod=1, node="node-1", generation=1, schedule_cnt=1, proc_start_cnt=1)
    assert Env.LOCAL_CHECKPOINTS not in pod.variables({})
    told = dataclasses.replace(pod, local_checkpoints="/local/ckpt").variables({Env.JOB_ID: JOB})
    local = LocalCopies.from_env(3, told)
    assert local is not None and local.root == Path(f"/local/ckpt/node-1/job-{JOB}")
    assert LocalCopies.from_env(3, {Env.JOB_ID: JOB}) is None
    assert CheckpointManager(tmp_path).local is None


@pytest.mark.parametrize("value", ["ckpt/local", "", "/tmp/\x00", 7, "/" + "a" * 4096])
def test_a_local_checkpoint_dir_that_is_not_an_absolute_path_is_refused_with_what_it_must_be(
    value: Any,
) -> None:
    with pytest.raises(SpecError) as caught:
        job(AUTO, local_checkpoint_dir=value)
    said = {p.key: str(p) for p in caught.value.problems}
    assert "absolute directory path on each node's own disk" in said["spec.local_checkpoint_dir"]


def test_a_local_checkpoint_dir_reaches_the_spec() -> None:
    assert job(AUTO, local_checkpoint_dir="/local/ckpt").local_checkpoint_dir == "/local/ckpt"
    assert job(AUTO).local_checkpoint_dir is None


def test_an_agent_forgets_only_the_ended_jobs_copies_on_its_own_node(tmp_path: Path) -> None:
    saved(tmp_path, [20, 30])
    other = LocalCopies(tmp_path / "local" / "node-0" / "job-8", "node-0", keep=2)
    other.copy(5, "rank-0.ckpt", tmp_path / "storage" / "step-000000030" / "rank-0.ckpt")
    assert other.wait(30) and other.path(5, "rank-0.ckpt").exists()
    assert not forget_job(tmp_path / "local", "node-1", JOB)  # another node's: nothing there
    assert forget_job(tmp_path / "local", "node-0", JOB)
    assert not local_of(tmp_path, "node-0").root.exists()
    assert other.path(5, "rank-0.ckpt").exists()  # job 8 runs on
    assert forget_job(tmp_path / "local", "node-0", 8)
    assert list((tmp_path / "local").iterdir()) == []  # the node's directory went with its last


def test_a_step_only_the_nodes_disk_holds_whole_counts_for_the_common_checkpoint(
    world_of_one: None, tmp_path: Path
) -> None:
    """Step 30's shard is gone from storage (its manifest is there): the node's copy makes it a
    step this rank can resume from, so `load_common_checkpoint` takes it from the node's disk
    instead of going back to step 20. A copy of another size does not count."""
    from relaunch.train.distributed import load_common_checkpoint

    saved(tmp_path, [20, 30])
    (tmp_path / "storage" / "step-000000030" / "rank-0.ckpt").unlink()
    assert CheckpointManager(tmp_path / "storage", rank=0).verified_steps() == [20]
    manager = restarted(tmp_path)
    assert manager.verified_steps() == [30, 20]
    loaded = load_common_checkpoint(manager)
    assert loaded is not None and loaded.step == 30 and same(loaded.state, state(30))
    assert manager.restored_from == {(0, 30): "local disk of node-0"}
    path = local_file(tmp_path, 30)
    path.write_bytes(path.read_bytes() + b"\0")
    assert restarted(tmp_path).verified_steps() == [20]


def test_what_a_copy_killed_half_way_left_goes_when_its_step_rotates_out(tmp_path: Path) -> None:
    manager = saved(tmp_path, [10])
    torn = local_file(tmp_path, 20).with_name(".rank-0.ckpt.tmp-999999")
    torn.parent.mkdir(parents=True)
    torn.write_bytes(b"half")  # the process that copied step 20 was killed mid-copy
    for step in (30, 40):
        manager.save(step, state(step))
        assert manager.local is not None and manager.local.wait(30)
    root = local_of(tmp_path, "node-0").root
    assert sorted(p.name for p in root.iterdir()) == ["step-000000030", "step-000000040"]


@pytest.mark.parametrize("async_save", [True, False], ids=["async-save", "sync-save"])
def test_a_save_returns_while_both_copies_are_still_being_made_off_the_training_thread(
    tmp_path: Path,
    nodes: dict[str, PeerMemoryServer],
    monkeypatch: pytest.MonkeyPatch,
    async_save: bool,
) -> None:
    """The copies add nothing to the loop's wait (issue 48's stall): the loop only hands them
    over. Each copy is held at its start until the loop is past the save and its wait for the
    asynchronous write; a copy made on the loop's thread, or waited for by it, would hold the
    loop instead, and the copy would find the loop not yet past (its hold ends in 30 s)."""
    loop = threading.current_thread()
    past_the_save = threading.Event()
    seen: list[tuple[str, bool, bool]] = []  # (copy, on the loop's thread, loop past the save)

    def held(kind: str, make: Any) -> Any:
        def start(self: Any, *args: Any) -> None:
            seen.append((kind, threading.current_thread() is loop, past_the_save.wait(30)))
            make(self, *args)

        return start

    monkeypatch.setattr(PeerCopies, "_send", held("peer", PeerCopies._send))
    monkeypatch.setattr(LocalCopies, "_copy", held("local", LocalCopies._copy))
    manager = CheckpointManager(
        tmp_path / "storage",
        rank=0,
        keep=2,
        async_save=async_save,
        peers=peers_of("node-0", nodes),
        local=local_of(tmp_path, "node-0"),
    )
    manager.save(20, state(20))
    manager.wait()  # the write to storage, which the copies follow
    past_the_save.set()
    assert manager.peers is not None and manager.peers.wait(30)
    assert manager.local is not None and manager.local.wait(30)
    assert sorted(seen) == [("local", False, True), ("peer", False, True)]
    assert manager.peers.sent[-1] == (20, "node-1") and not manager.local.failures
    assert (
        local_file(tmp_path, 20).read_bytes()
        == (tmp_path / "storage" / "step-000000020" / "rank-0.ckpt").read_bytes()
    )


def test_an_agent_told_as_it_joins_of_ended_jobs_removes_its_nodes_copies_of_them_only(
    tmp_path: Path,
) -> None:
    """A real agent process, its controller a socket here. Job 1 ended while no agent of node-1
    heard it (the controller killed before its last message, or node-1 lost during the job);
    job 2 runs now. As the agent joins, it is told of job 1 (ForgetCopies) and removes its
    node's copies of job 1, not job 2's, and beats on while it does. At job 2's end it is told
    of job 2 and shut down at once: it removes those copies before it exits."""
    base = tmp_path / "local"
    for job_id in (1, 2):
        shard = job_root(base, "node-1", job_id) / "step-000000010" / "rank-1.ckpt"
        shard.parent.mkdir(parents=True)
        shard.write_bytes(bytes(4096))
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        agent = subprocess.Popen(
            [sys.executable, "-m", "relaunch.cluster.agent", "--state-dir", str(tmp_path / "s"),
             "--node", "node-1", "--chips", "1", "--simulate-chips", "--interval", "0.1",
             "--controller", f"127.0.0.1:{server.getsockname()[1]}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            conn = Connection(server.accept()[0])
            heard = iter(conn)
            assert isinstance(hello := next(heard), AgentHello) and hello.node == "node-1"
            conn.send(ForgetCopies(((str(base), 1), (str(tmp_path / "elsewhere"), 7))))
            beats = 0
            for message in heard:  # at most 300 beats (30 s) for the removal
                beats += isinstance(message, Heartbeat)
                if not job_root(base, "node-1", 1).exists() or beats == 300:
                    break
            left = [p.relative_to(base).parts[:2] for p in base.rglob("*.ckpt")]
            # job 2's end: told, then shut down at once; the agent removes before it exits
            conn.send(ForgetCopies(((str(base), 2),)))
            conn.send(Shutdown())
            said, _ = agent.communicate(timeout=60)
        finally:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, said
    assert left == [("node-1", "job-2")], said
    assert "agent node-1: removed job 1's local checkpoint copies" in said, said
    assert "agent node-1: removed job 2's local checkpoint copies" in said, said
    assert list(base.iterdir()) == [] and not (tmp_path / "elsewhere").exists()
