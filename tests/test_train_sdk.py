"""The training SDK: checkpoints (atomic, verified, rotated, async, corrupted), dying gasp,
reentrancy helpers, progress reports, the job environment."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from relaunch.protocol.datagrams import parse_datagram
from relaunch.train import (
    CheckpointManager,
    CheckpointWarning,
    env,
    recreate_shared_memory,
    report_progress,
)

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip_of_plain_numpy_and_torch_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {
        "step": 7,
        "data": {"epoch": 1, "offset": 4096},
        "array": np.arange(10.0),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
    }
    manager = CheckpointManager(tmp_path, rank=2)
    manager.save(7, state)
    loaded = manager.load()
    assert loaded is not None and loaded.step == 7
    assert loaded.state["data"] == {"epoch": 1, "offset": 4096}
    np.testing.assert_array_equal(loaded.state["array"], np.arange(10.0))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state["model"][name], tensor)
    restored = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    restored.load_state_dict(loaded.state["optimizer"])
    assert torch.equal(loaded.state["rng"], state["rng"])
    assert sorted(p.name for p in loaded.path.iterdir()) == ["rank-2.ckpt", "rank-2.manifest.json"]


def test_plain_python_state_is_saved_and_loaded_without_importing_torch(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from relaunch.train import CheckpointManager
        m = CheckpointManager({str(tmp_path)!r}, rank=0)
        m.save(3, {{"w": [1.5, 2.5]}})
        print(m.load().state, "torch" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "{'w': [1.5, 2.5]} False"
    manifest = json.loads((tmp_path / "step-000000003" / "rank-0.manifest.json").read_text())
    assert manifest["format"] == "relaunch-shard-2"
    shard = (tmp_path / "step-000000003" / "rank-0.ckpt").read_bytes()
    assert b'"rest"' in shard and b'"t0"' not in shard  # no tensors: only the pickled rest


def test_keeps_the_last_k_steps(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, rank=0, keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, {"step": step})
    assert manager.steps() == [4, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000004"]


def test_maybe_save_every_n_steps_calls_the_state_function_only_then(tmp_path: Path) -> None:
    calls: list[int] = []
    manager = CheckpointManager(tmp_path, rank=0, every=5)
    for step in range(1, 13):
        manager.maybe_save(step, lambda step=step: calls.append(step) or {"step": step})
    assert calls == [5, 10] and manager.steps() == [10, 5]


def test_a_shard_without_its_manifest_does_not_count(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, rank=0)
    manager.save(1, {"step": 1})
    half = tmp_path / "step-000000002"
    half.mkdir()
    (half / "rank-0.ckpt").write_bytes(b"written, then the process died before the manifest")
    assert manager.load().step == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "delete"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(
    tmp_path: Path, damage: str
) -> None:
    manager = CheckpointManager(tmp_path, rank=1)
    weights = torch.arange(1000, dtype=torch.float32)
    manager.save(10, {"w": weights})
    manager.save(20, {"w": weights * 2})
    newest = tmp_path / "step-000000020"
    shard = newest / "rank-1.ckpt"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "manifest":
        (newest / "rank-1.manifest.json").write_text("{not json")
    else:
        shard.unlink()
    with pytest.warns(CheckpointWarning, match="step 20 of rank 1"):
        loaded = manager.load()
    assert loaded is not None and loaded.step == 10 and torch.equal(loaded.state["w"], weights)


def test_nothing_usable_is_none_not_a_crash(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, rank=0)
    assert manager.load() is None
    manager.save(1, {"x": 1})
    (tmp_path / "step-000000001" / "rank-0.ckpt").write_bytes(b"")
    with pytest.warns(CheckpointWarning):
        assert manager.load() is None


def test_async_save_writes_a_snapshot_that_later_steps_cannot_change(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, rank=0, async_save=True)
    weights = torch.zeros(1000)
    state = {"w": weights, "meta": {"step": 1}}
    manager.save(1, state)
    weights += 1  # the next training step, in place
    state["meta"]["step"] = 2
    manager.wait()
    loaded = manager.load()
    assert loaded is not None
    assert torch.equal(loaded.state["w"], torch.zeros(1000)) and loaded.state["meta"] == {"step": 1}


def test_another_ranks_shard_can_be_read_for_replicated_state(tmp_path: Path) -> None:
    CheckpointManager(tmp_path, rank=0).save(5, {"who": 0})
    manager = CheckpointManager(tmp_path, rank=3)
    assert manager.load() is None
    assert manager.verified_steps(rank=0) == [5]
    assert manager.load(5, rank=0).state == {"who": 0}  # type: ignore[union-attr]


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)
    with pytest.raises(ValueError, match="every"):
        CheckpointManager(tmp_path, every=0)


# -- dying gasp -------------------------------------------------------------------------------------

GASP_SCRIPT = """
import os, sys, time
from relaunch.train import CheckpointManager
m = CheckpointManager(sys.argv[1], rank=0)
state = {"w": 0}
m.dying_gasp(lambda: dict(state))
for step in range(1, 10_000):
    if os.environ.get("STALE_AT") == str(step):  # as the keeper learns its pod was replaced
        from relaunch.train.following import GroupLost, gasp_if_stale
        with gasp_if_stale(m):
            raise GroupLost("rank 0: pod 0 was replaced (generation 2); this process is stale")
    with m.step(step):
        state["w"] = step
        if os.environ.get("FAIL_AT") == str(step):
            raise RuntimeError("a peer died in the middle of a collective")
        print("step", step, flush=True)
        time.sleep(0.01)
"""


def _gasp(tmp_path: Path, extra_env: dict[str, str]) -> tuple[int, int]:
    script = tmp_path / "gasp.py"
    script.write_text(GASP_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **extra_env},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        early = "FAIL_AT" in extra_env or "STALE_AT" in extra_env
        if line.startswith("step 20") or (early and line.startswith("step 4")):
            break
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=10)
    loaded = CheckpointManager(tmp_path / "ckpt", rank=0).load()
    assert loaded is not None
    return code, loaded.step


def test_dying_gasp_saves_the_last_completed_step_on_sigterm(tmp_path: Path) -> None:
    code, step = _gasp(tmp_path, {})
    assert code == 143 and step >= 20


def test_dying_gasp_after_a_failed_step_saves_the_step_before_it(tmp_path: Path) -> None:
    code, step = _gasp(tmp_path, {"FAIL_AT": "5", "RELAUNCH_JOB_ID": "1"})
    assert code == 143 and step == 4


def test_r34_a_rank_told_it_is_stale_waits_for_the_sigterm_and_its_gasp_saves(
    tmp_path: Path,
) -> None:
    """A job-level rebuild's new membership can reach a rank before relaunch's SIGTERM (CI saw
    the dump level's ranks exit on GroupLost with nothing saved): a rank with a gasp armed that
    learns it is stale waits for the SIGTERM, and its gasp saves the last completed step."""
    code, step = _gasp(tmp_path, {"STALE_AT": "5", "RELAUNCH_JOB_ID": "1"})
    assert code == 143 and step == 4


# -- reentrancy, progress, environment ----------------------------------------------------------------


def test_once_per_container_runs_setup_once_across_processes_and_restarts(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import time
        from relaunch.train import once_per_container
        def download():
            with open("downloads.txt", "a") as f:
                f.write("x")
            time.sleep(0.3)
        print(once_per_container("data", download))
        """
    )
    env_ = {**os.environ, "RELAUNCH_WORKDIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=tmp_path, env=env_, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outputs = sorted(p.communicate(timeout=30)[0].strip() for p in procs)
    assert outputs == ["False", "False", "True"]
    assert (tmp_path / "downloads.txt").read_text() == "x"
    again = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env_, capture_output=True, text=True
    )
    assert again.stdout.strip() == "False"  # an in-place restart: same container, setup skipped


def test_recreate_shared_memory_replaces_a_stale_segment() -> None:
    name = f"relaunch-test-{os.getpid()}"
    stale = recreate_shared_memory(name, 16)
    stale.buf[0] = 42
    stale.close()  # the process that made it is gone; the segment is left behind
    fresh = recreate_shared_memory(name, 32)
    try:
        assert fresh.size >= 32 and fresh.buf[0] == 0
    finally:
        fresh.close()
        fresh.unlink()


def test_report_progress_sends_rank_and_step_to_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import relaunch.train.progress as progress

    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"relaunch-test-progress-{os.getpid()}"
    receiver.bind("\0" + name)
    monkeypatch.setenv("RELAUNCH_PROGRESS_SOCKET", "@" + name)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setattr(progress, "_addresses", None)
    monkeypatch.setattr(progress, "_sent_at", None)
    before = time.time()
    report_progress(12)
    parsed = parse_datagram(receiver.recv(64))
    assert parsed is not None and parsed[:2] == (5, 12)
    assert parsed[2] is not None and before <= parsed[2] <= time.time()  # when it was reported
    receiver.close()


def test_a_phase_waits_for_room_in_a_full_launcher_queue_and_a_routine_step_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launcher starved by a busy machine leaves its queue full (10 datagrams by default): a
    phase (R-37 depends on it) waits until the launcher reads, a routine step is dropped, and
    goes again, urgently, before the phase that is about it (the R-37 end-to-end test once saw
    a save at step 40 that the controller knew only as one at step 36)."""
    import threading

    import relaunch.train.progress as progress

    sockets = {}
    for kind in ("routine", "urgent"):
        sockets[kind] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sockets[kind].bind(f"\0relaunch-test-full-{kind}-{os.getpid()}")
        sockets[kind].setblocking(False)
    monkeypatch.setenv("RELAUNCH_PROGRESS_SOCKET", f"@relaunch-test-full-routine-{os.getpid()}")
    monkeypatch.setenv("RELAUNCH_URGENT_SOCKET", f"@relaunch-test-full-urgent-{os.getpid()}")
    monkeypatch.setenv("RELAUNCH_PROGRESS_EVERY_S", "0")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(progress, "_addresses", None)
    monkeypatch.setattr(progress, "_sent_at", 0.0)
    monkeypatch.setattr(progress, "_socket", None)
    monkeypatch.setattr(progress, "_newest", None)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    for kind in ("routine", "urgent"):
        with contextlib.suppress(BlockingIOError):
            while True:
                filler.sendto(b"x", f"\0relaunch-test-full-{kind}-{os.getpid()}")

    def drain(sock: socket.socket) -> list[bytes]:
        out = []
        with contextlib.suppress(BlockingIOError):
            while True:
                out.append(sock.recv(256))
        return out

    waits: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", waits.append)
    report_progress(7)  # routine, queue full: dropped at once, without waiting for room
    monkeypatch.setattr(time, "sleep", real_sleep)
    assert waits == []
    reader = threading.Timer(0.1, lambda: drained.extend(drain(sockets["urgent"])))
    drained: list[bytes] = []
    reader.start()
    progress.report_phase(progress.SdkPhase.CHECKPOINT)  # waits for the reader to make room
    reader.join()
    drained += drain(sockets["urgent"])
    said = [parse_datagram(d) for d in drained if d != b"x"]
    assert [p[:2] for p in said if p is not None] == [(1, 7), (1, progress.SdkPhase.CHECKPOINT)]
    assert all(parse_datagram(d) is None for d in drain(sockets["routine"]))
    filler.close()
    for sock in sockets.values():
        sock.close()


def test_report_progress_sends_the_first_step_and_phases_at_once_and_steps_at_most_every_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher wakes only for the urgent socket: a rank's first step (it proves a restart
    worked) and its phases (R-37) go there; later steps go to the routine socket, no more often
    than RELAUNCH_PROGRESS_EVERY_S."""
    import relaunch.train.progress as progress

    sockets = {}
    for kind in ("routine", "urgent"):
        sockets[kind] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sockets[kind].bind(f"\0relaunch-test-{kind}-{os.getpid()}")
        sockets[kind].setblocking(False)
    monkeypatch.setenv("RELAUNCH_PROGRESS_SOCKET", f"@relaunch-test-routine-{os.getpid()}")
    monkeypatch.setenv("RELAUNCH_URGENT_SOCKET", f"@relaunch-test-urgent-{os.getpid()}")
    monkeypatch.setenv("RELAUNCH_PROGRESS_EVERY_S", "0.2")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setattr(progress, "_addresses", None)
    monkeypatch.setattr(progress, "_sent_at", None)

    def received(kind: str, whole: bool = False) -> list[bytes]:
        """The datagrams, without the time a step was reported unless `whole`."""
        out = []
        while True:
            try:
                data = sockets[kind].recv(64)
            except BlockingIOError:
                return out
            out.append(data if whole else b" ".join(data.split()[:2]))

    monkeypatch.setattr(progress, "_pending", None)
    monkeypatch.setattr(progress, "_newest", None)
    report_progress(1)
    report_progress(2)  # within the interval: held back
    assert received("urgent") == [b"2 1"]
    progress.report_phase("saving")  # the step the phase is about goes first
    assert received("urgent") == [b"2 2", b"2 @saving"]
    assert received("routine") == []
    monkeypatch.setattr(progress, "_sent_at", (progress._sent_at or 0.0) - 0.3)
    report_progress(3)
    reported = time.time()
    report_progress(4)  # held back, sent when the process exits
    assert received("routine") == [b"2 3"]
    time.sleep(0.05)
    progress._flush_pending()
    [late] = received("routine", whole=True)
    parsed = parse_datagram(late)
    assert parsed is not None and parsed[:2] == (2, 4)
    assert parsed[2] is not None and parsed[2] < reported + 0.05  # when reported, not sent
    assert received("urgent") == []
    for sock in sockets.values():
        sock.close()


def test_report_progress_never_blocks_when_nobody_reads() -> None:
    code = textwrap.dedent(
        """
        import os, socket
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        receiver.bind("\\0relaunch-test-full-%d" % os.getpid())
        os.environ["RELAUNCH_PROGRESS_SOCKET"] = "@relaunch-test-full-%d" % os.getpid()
        from relaunch.train import report_progress
        for step in range(50_000):
            report_progress(step)
        print("returned")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "returned", done.stderr


def test_report_progress_outside_relaunch_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import relaunch.train.progress as progress

    monkeypatch.delenv("RELAUNCH_PROGRESS_SOCKET", raising=False)
    monkeypatch.delenv("RELAUNCH_URGENT_SOCKET", raising=False)
    monkeypatch.setattr(progress, "_addresses", None)
    report_progress(1)


def test_env_reads_the_job_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "RELAUNCH_POD": "1",
        "MA_SCHEDULE_CNT": "2",
        "MA_PROC_START_CNT": "3",
        "RELAUNCH_ATTEMPT": "5",
    }.items():
        monkeypatch.setenv(name, value)
    job = env()
    assert (job.rank, job.local_rank, job.world_size, job.pod) == (3, 1, 4, 1)
    assert job.rescheduled and job.restarted_in_place and job.attempt == 5


def test_fencing_a_stale_generation_cannot_write_or_commit_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller's fence (RELAUNCH_SHARED_DIR/fence.json) names, for each pod moved off a
    lost node, the oldest generation allowed to write; a process of an older one (its node was
    declared lost and came back) must not touch the checkpoints the new generation loads."""
    import json

    from relaunch.train.checkpoint import FENCE_FILE, StaleProcess

    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("RELAUNCH_SHARED_DIR", str(shared))
    monkeypatch.setenv("RELAUNCH_POD", "1")
    monkeypatch.setenv("RELAUNCH_GENERATION", "1")
    fence = shared / FENCE_FILE
    manager = CheckpointManager(tmp_path / "ckpt", rank=2)
    manager.save(10, {"w": 1})  # no fence yet
    fence.write_text(json.dumps({"generations": {"0": 3}}))
    manager.save(11, {"w": 1})  # another pod was fenced, not this one
    fence.write_text(json.dumps({"generations": {"0": 3, "1": 2}}))
    with pytest.raises(StaleProcess, match="pod generation 1 is stale"):
        manager.save(20, {"w": 2})
    with pytest.raises(StaleProcess):
        manager.save(11, {"w": "overwritten"})
    assert manager.steps() == [11, 10]
    loaded = manager.load()
    assert loaded is not None and (loaded.step, loaded.state) == (11, {"w": 1})
    monkeypatch.setenv("RELAUNCH_GENERATION", "2")
    manager.save(20, {"w": 3})  # the new generation writes as usual
    assert manager.steps() == [20, 11, 10]


def test_the_last_step_held_back_is_sent_when_the_keeper_ends_the_process() -> None:
    """Issue 49: a job that completed step 160 reported 159. The DDP example ends by the keeper's
    exit (os._exit, which skips atexit, where the step held back by the report interval is
    sent): its last step never reached relaunch. The keeper's exit sends it first."""
    name = f"relaunch-test-exit-{os.getpid()}"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind("\0" + name)
    receiver.settimeout(30)
    code = textwrap.dedent(
        """
        from types import SimpleNamespace
        from relaunch.train import report_progress
        from relaunch.train.group import ProcessGroupKeeper
        for step in range(1, 161):
            report_progress(step)  # the first at once, the rest held back by the interval
        ProcessGroupKeeper.exit(SimpleNamespace(close=lambda: None), 0)
        """
    )
    env = {
        **os.environ,
        "RELAUNCH_PROGRESS_SOCKET": "@" + name,
        "RELAUNCH_URGENT_SOCKET": "@" + name,
        "RELAUNCH_PROGRESS_EVERY_S": "60",
        "RANK": "0",
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False)
    assert done.returncode == 0
    steps = []
    receiver.settimeout(0.5)
    with contextlib.suppress(TimeoutError):
        while True:
            parsed = parse_datagram(receiver.recv(64))
            if parsed is not None:
                steps.append(parsed[1])
    receiver.close()
    assert steps == [1, 160], steps


def test_the_membership_watcher_never_aborts_the_group_formed_after_the_step_it_saw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper's watcher aborts a step's group when a newer membership comes. Descheduled
    between its look and its abort (a loaded machine), it once could shut the connections of the
    group the loop had formed since: the loop cannot leave a step while the watcher decides,
    and once out of it the watcher aborts nothing."""
    import threading

    from relaunch.protocol.environment import Env
    from relaunch.protocol.plans import Membership
    from relaunch.train import group
    from relaunch.train.group import ProcessGroupKeeper

    monkeypatch.setenv(Env.MEMBERSHIP, str(tmp_path / "membership.json"))
    model = torch.nn.Linear(2, 1)
    keeper = ProcessGroupKeeper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    looking, go_on = threading.Event(), threading.Event()

    def slow_read(path: Path) -> Membership:
        looking.set()
        assert go_on.wait(30)
        return Membership(generation=keeper.generation + 1, addr="127.0.0.1", port=1, world_size=2)

    aborts: list[bool] = []
    monkeypatch.setattr(group, "read_membership", slow_read)
    monkeypatch.setattr(keeper, "_abort", lambda: aborts.append(keeper._step.inside))
    keeper._step.enter()
    watcher = threading.Thread(target=keeper._watch, daemon=True)
    watcher.start()
    assert looking.wait(30)
    left = threading.Event()
    leaving = threading.Thread(target=lambda: (keeper._step.leave(), left.set()), daemon=True)
    leaving.start()
    assert not left.wait(0.5), "the loop left the step while the watcher was deciding"
    go_on.set()
    assert left.wait(30)
    looking.clear()
    assert not looking.wait(0.5), "out of the step, the watcher still read the membership"
    keeper._closing.set()
    watcher.join(30)
    assert aborts == [True], "an abort landed after the step was left"
