"""Sharded state (torch.distributed.checkpoint) with the SDK's guarantees: an FSDP2 job faulted
under relaunch ends bit-identical to its fault-free run under torchrun; a checkpoint saved by 2
ranks loads on 1 and on 3; a flipped byte or a torn save is never loaded; an asynchronous save
is committed at the next save. Real torch.distributed, real processes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from relaunch.train import CheckpointWarning
from relaunch.train.sharded import MANIFEST, ShardedCheckpointManager
from tests.runtime import FSDP_SCRIPT as SCRIPT
from tests.runtime import final_hash, torchrun

ROOT = Path(__file__).resolve().parents[1]


def test_fsdp2_faulted_under_relaunch_ends_bit_identical_to_its_fault_free_run(
    tmp_path: Path, fsdp_unbroken: str
) -> None:
    """Asynchronous saves (the dying gasp saves synchronously; the other tests of this file
    save synchronously too), against the fault-free run's synchronous ones: how a save is made
    changes nothing of the training."""
    extra = ["--async-save"]
    plan = tmp_path / "faults.yaml"
    plan.write_text(
        yaml.safe_dump(
            {
                "faults": [
                    {"kind": "process-exit", "at_step": 12, "pod": 1, "rank": 1},
                    # every rank stopped with a grace: a collective dying gasp saves
                    {"kind": "chip-fault", "at_step": 22, "pod": 1, "chip": 0, "code": "80E3A201"},
                    {"kind": "node-down", "at_step": 33, "pod": 0},
                ]
            }
        )
    )
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "run", "--state-dir", str(tmp_path / "state"),
         "--faults", str(plan), "--report", str(report), "--nnodes", "2",
         "--nproc-per-node", "1", "--monitor-interval", "0.2", "--label",
         "fault-scheduling=grace", "--label", "grace-over-time=10", str(SCRIPT), "--steps",
         "45", *extra],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    summary = json.loads(report.read_text())
    assert [e["state"] for e in summary["fault_plan"]] == ["fired"] * 3
    assert [r["action"] for r in summary["recoveries"]] == [
        "job-reschedule",
        "isolated-job-reschedule",
        "isolated-job-reschedule",
    ]
    # each attempt's start, as the ranks printed it (echoed "[pod i rank r] ..." lines)
    resumed = [int(n) for n in re.findall(r"\] start: rank \d+/2 resume_step=(\d+)", said)]
    # four attempts of two ranks, both ranks of one attempt at one step, never going back. Two
    # attempts may begin at the same step: an asynchronous save is committed at the next save,
    # so a node lost between them (the controller acts within a step or two of at_step) leaves
    # the previous checkpoint the newest one (CI saw 27 twice: the gasp, then save 30 pending)
    assert len(resumed) == 8, resumed
    attempts = [resumed[i] for i in range(0, 8, 2)]
    assert [resumed[i + 1] for i in range(0, 8, 2)] == attempts, resumed
    assert attempts[0] == 0 and attempts == sorted(attempts) and attempts[1] > 0, resumed
    logs = "".join(p.read_text() for p in (tmp_path / "state").glob("jobs/*/pods/*/logs/*.log"))
    gasps = re.findall(r"dying gasp (saved step \d+|skipped|failed)", logs)
    assert gasps, logs[-3000:]  # the chip fault stopped both ranks with a grace: each tried
    for step in {int(g.split()[-1]) for g in gasps if g.startswith("saved")}:
        assert step in attempts, (gasps, attempts)  # a committed gasp is where the next began
    assert final_hash(said) == fsdp_unbroken


@pytest.fixture(scope="module")
def saved_by_2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A checkpoint directory 2 ranks saved (12 steps, every 4), and their final parameters'
    hash: saved once for the tests below, each of which works on a copy of its own."""
    tmp = tmp_path_factory.mktemp("saved-by-2")
    ckpt = tmp / "ckpt"
    output = torchrun(2, "--steps", "12", "--ckpt-every", "4", "--ckpt-dir", str(ckpt), cwd=tmp)
    return ckpt, final_hash(output)


def test_a_sharded_checkpoint_saved_by_2_ranks_loads_on_1_and_on_3(
    tmp_path: Path, saved_by_2: tuple[Path, str]
) -> None:
    """The world size changes after an elastic scale-in (or out): DCP reshards on load."""
    ckpt = shutil.copytree(saved_by_2[0], tmp_path / "ckpt")
    for ranks in (1, 3):
        output = torchrun(ranks, "--steps", "12", "--ckpt-dir", str(ckpt), cwd=tmp_path)
        assert f"start: rank 0/{ranks} resume_step=12" in output
        assert final_hash(output) == saved_by_2[1]


def test_a_flipped_byte_is_never_loaded_the_step_before_is(
    tmp_path: Path, saved_by_2: tuple[Path, str]
) -> None:
    ckpt = shutil.copytree(saved_by_2[0], tmp_path / "ckpt")
    shard = ckpt / "step-000000012" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    output = torchrun(2, "--steps", "12", "--ckpt-dir", str(ckpt), cwd=tmp_path)
    assert "resume_step=8" in output and "resume_step=12" not in output


# -- the manager's rules, in one process (a world of one) ---------------------------------------


def test_sharded_checkpoints_need_torch_distributed() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedCheckpointManager("unused")


def test_save_load_rotate_and_a_torn_save_is_skipped(world_of_one: None, tmp_path: Path) -> None:
    manager = ShardedCheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((4,), float(step)), "step": step})
    assert manager.steps() == [3, 2]  # rotated
    (tmp_path / "step-000000003" / MANIFEST).unlink()  # torn: renamed, manifest never written
    into = {"w": torch.zeros(4), "step": 0}
    loaded = manager.load(into=into)
    assert loaded is not None and loaded.step == 2
    assert torch.equal(into["w"], torch.full((4,), 2.0)) and into["step"] == 2
    with pytest.raises(TypeError, match="load\\(into=state\\)"):
        manager.load()


def test_a_corrupted_newest_step_falls_back_with_a_warning(
    world_of_one: None, tmp_path: Path
) -> None:
    manager = ShardedCheckpointManager(tmp_path)
    manager.save(1, {"w": torch.ones(8)})
    manager.save(2, {"w": torch.full((8,), 2.0)})
    (tmp_path / "step-000000002" / ".metadata").write_bytes(b"garbage")
    into = {"w": torch.zeros(8)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = manager.load(into=into)
    assert loaded is not None and loaded.step == 1 and torch.equal(into["w"], torch.ones(8))
    assert any(issubclass(w.category, CheckpointWarning) for w in caught)
    assert manager.verified_steps() == [1]


def test_an_async_save_counts_once_committed_and_a_dead_runs_leftovers_are_swept(
    world_of_one: None, tmp_path: Path
) -> None:
    leftover = tmp_path / ".step-000000007.tmp-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half")
    manager = ShardedCheckpointManager(tmp_path, async_save=True)
    assert not leftover.exists()
    state = {"w": torch.arange(6.0)}
    manager.save(5, state)
    state["w"].add_(100)  # the training goes on: the save has its own copy
    manager.wait()
    assert manager.steps() == [5]
    into = {"w": torch.zeros(6)}
    assert manager.load(into=into) is not None
    assert torch.equal(into["w"], torch.arange(6.0))


GASPING = """
import os, sys, time, torch, torch.distributed as dist
from relaunch.train.sharded import ShardedCheckpointManager
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store", rank=0, world_size=1)
ckpt = ShardedCheckpointManager(sys.argv[1], every=1000)
w = torch.zeros(4)
ckpt.dying_gasp(lambda: {"w": w.clone(), "step": ckpt.completed_step})
for step in range(1, 10**6):
    with ckpt.step(step):
        w += 1
    print(f"step {step}", flush=True)
    time.sleep(0.01)
"""


def test_a_sharded_dying_gasp_saves_the_last_completed_step(tmp_path: Path) -> None:
    import os
    import signal

    env = {**os.environ, "RELAUNCH_JOB_ID": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", GASPING, str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("step 5"):
            child.send_signal(signal.SIGTERM)
            break
    rest = child.stdout.read()
    assert child.wait(timeout=60) == 143
    saved = int(re.findall(r"dying gasp saved step (\d+)", rest)[0])
    assert saved >= 5
    store = tmp_path / "store-again"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        into = {"w": torch.zeros(4), "step": 0}
        loaded = ShardedCheckpointManager(tmp_path).load(into=into)
        assert loaded is not None and loaded.step == saved == into["step"]
        assert torch.equal(into["w"], torch.full((4,), float(saved)))
    finally:
        dist.destroy_process_group()
