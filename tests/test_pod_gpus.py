"""A pod sees its chips, and only them (issue 46): where the embedded cluster's chips are the
machine's GPUs, each pod's ranks get CUDA_VISIBLE_DEVICES (and NVIDIA_VISIBLE_DEVICES) naming
the GPUs its chips are, and LOCAL_RANK picks among them. Before: every rank saw every GPU of the
machine, two one-chip pods on one node both took cuda:0, and NCCL refused the group ("Duplicate
GPU detected"). On the controller simulator (its engine told its chips are GPUs), and the
refusal of a cluster of more chips than GPUs through the command line."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relaunch.cli import app
from relaunch.cluster.nvml import SIMULATE_CHIPS_ENV, chips_problem
from tests.controller_sim import Sim, job_spec

POD_LEVEL = {"fault-tolerance/job-retry-num": "4", "fault-tolerance/pod-retry-num": "2"}


def gpu_sim(tmp: Path, annotations: dict[str, str] | None = None, **spec: object) -> Sim:
    sim = Sim(tmp, job_spec(annotations or POD_LEVEL, **spec), nodes=4)
    sim.engine.facts = dataclasses.replace(sim.engine.facts, chips_are_gpus=True)  # type: ignore[misc]
    sim.boot()
    return sim


def visible(sim: Sim) -> dict[tuple[int, int], tuple[str, str | None]]:
    """(pod, generation) -> (node, CUDA_VISIBLE_DEVICES) of every launcher started."""
    return {
        (plan.pod, plan.generation): (plan.node, plan.env.get("CUDA_VISIBLE_DEVICES"))
        for plan in sim.engine.plans  # type: ignore[attr-defined]
    }


def test_two_one_chip_pods_on_one_node_see_different_gpus(tmp_path: Path) -> None:
    """The issue's spec: two pods of one chip each on nodes of two chips share node-0; pod 0
    sees GPU 0, pod 1 GPU 1 (node-0's chips are the machine's GPUs 0-1)."""
    sim = gpu_sim(tmp_path, replicas=2, procs_per_pod=1, chips_per_pod=1)
    assert visible(sim) == {(0, 1): ("node-0", "0"), (1, 1): ("node-0", "1")}
    for plan in sim.engine.plans:  # type: ignore[attr-defined]
        assert plan.env["NVIDIA_VISIBLE_DEVICES"] == plan.env["CUDA_VISIBLE_DEVICES"]


def test_a_pod_of_two_chips_sees_its_nodes_two_gpus(tmp_path: Path) -> None:
    """Two ranks a pod: LOCAL_RANK 0 and 1 pick cuda:0 and cuda:1 among the pod's own GPUs."""
    sim = gpu_sim(tmp_path, replicas=2, procs_per_pod=2, chips_per_pod=2)
    assert visible(sim) == {(0, 1): ("node-0", "0,1"), (1, 1): ("node-1", "2,3")}


def test_a_rescheduled_pod_sees_its_new_nodes_gpus(tmp_path: Path) -> None:
    sim = gpu_sim(tmp_path, replicas=2, procs_per_pod=2, chips_per_pod=2)
    sim.train(1)
    sim.tick()
    sim.kill_node("node-1")
    sim.run(2.0)
    assert [a for a, _ in sim.actions()] == ["pod-reschedule"]
    seen = visible(sim)
    assert seen[(1, 2)] == ("node-2", "4,5")  # node-2's chips: GPUs 4-5
    assert seen[(0, 1)] == ("node-0", "0,1") and (0, 2) not in seen  # restarted in its own


def test_a_job_that_sets_cuda_visible_devices_itself_keeps_it(tmp_path: Path) -> None:
    sim = gpu_sim(
        tmp_path, replicas=2, procs_per_pod=1, chips_per_pod=1, env={"CUDA_VISIBLE_DEVICES": "7"}
    )
    assert {v for _, v in visible(sim).values()} == {"7"}


def test_simulated_chips_give_no_pod_a_gpu(tmp_path: Path) -> None:
    sim = Sim(tmp_path, job_spec(POD_LEVEL, replicas=2, procs_per_pod=1, chips_per_pod=1))
    sim.boot()
    assert all("CUDA_VISIBLE_DEVICES" not in p.env for p in sim.engine.plans)  # type: ignore[attr-defined]


def test_more_chips_than_the_machine_has_gpus_is_a_problem() -> None:
    assert chips_problem(8, 8) is None and chips_problem(8, None) is None
    assert chips_problem(8, 0) is None  # no GPU: simulated chips, as on a CPU machine
    said = chips_problem(8, 1)
    assert said is not None and "8 chips would be GPUs 0-7" in said and "has 1" in said
    assert "--simulate-chips" in said


def test_a_cluster_of_more_chips_than_gpus_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine of one GPU, four nodes of two chips would be GPUs 0-7: exit 2, saying so,
    nothing stored; with --simulate-chips the chips are simulated and the check is not made."""
    import relaunch.engines.embedded as run_command

    monkeypatch.setattr(run_command, "gpu_count", lambda: 1)
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    state = tmp_path / "state"
    args = ["run", "examples/toy-job.yaml", "--state-dir", str(state), "--nodes", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    said = " ".join(result.stderr.split())
    assert "8 chips would be GPUs 0-7 of this machine, which has 1" in said, said
    jobs = CliRunner().invoke(app, ["jobs", "--state-dir", str(state)])
    assert "toy" not in jobs.stdout

    monkeypatch.setenv(SIMULATE_CHIPS_ENV, "0")  # undone after the test: the run sets it
    monkeypatch.setattr(run_command, "gpu_count", lambda: None)  # as --simulate-chips makes it
    refused = CliRunner().invoke(
        app, ["run", "no-such-job.yaml", "--simulate-chips", "--state-dir", str(state)]
    )
    assert refused.exit_code == 2 and "would be GPUs" not in refused.stderr
    assert os.environ[SIMULATE_CHIPS_ENV] == "1"  # what the engine and its agents read
