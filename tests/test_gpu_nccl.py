"""On a real NVIDIA GPU, over NCCL: the DDP example through a crash, a chip fault, a lost node and a
hang (job, container and pod level), and through each process level (an online retry, a rank
replaced in place, a pod moved to a standby node), each run ending bit-identical to its fault-free
run, with dropout drawing from the GPU's random stream (which the checkpoints then hold).

Runs where torch sees a CUDA GPU and NCCL, and is skipped elsewhere, saying so (CI has no GPU;
docs/gpus.md and docs/benchmark-history.md say where it ran). One rank per pod: NCCL refuses two ranks of one
host on one GPU, and each pod's node is a host of its own to NCCL (NCCL_HOSTID), so the pods' ranks
may share the machine's one GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from relaunch.train import CheckpointManager
from tests.runtime import DDP_CLUSTER, DDP_FAULTS, ROOT, Cluster, Result, ddp_job


def _cuda_and_nccl() -> str | None:
    """Why the GPU tests cannot run here (None: they can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (
            "no CUDA GPU here (torch.cuda.is_available() is False): these tests need an NVIDIA GPU"
        )
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None


pytestmark = pytest.mark.skipif(_cuda_and_nccl() is not None, reason=str(_cuda_and_nccl()))

ON_GPU = "--device cuda --dropout 0.1"
PROCESS_JOB = yaml.safe_load((ROOT / "examples" / "ddp" / "process-job.yaml").read_text())
SCRIPT = ROOT / "examples" / "ddp" / "train_ddp.py"


def gpu_job(out: Path) -> dict[str, Any]:
    job = ddp_job(out, 10)
    job["spec"]["command"] += f" {ON_GPU}"
    return job


def gpu_process_job(out: Path) -> dict[str, Any]:
    job = yaml.safe_load(yaml.safe_dump(PROCESS_JOB))
    job["spec"]["procs_per_pod"] = 1
    job["spec"]["command"] = (
        f"python {SCRIPT} --process-recovery --steps 120 --ckpt-every 10 --out {out} {ON_GPU}"
    )
    return job


def run(cluster: Cluster, job: dict[str, Any], faults: list[dict[str, Any]] | None) -> Result:
    result = cluster.run(job, faults, DDP_CLUSTER, timeout=400, startup_s=90)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("gpu-unbroken")
    result = run(Cluster(tmp), gpu_job(tmp / "hash.txt"), None)
    assert result.report["recoveries"] == []
    assert "backend: nccl on cuda:0" in result.logs()
    return (tmp / "hash.txt").read_text().strip()


@pytest.fixture(scope="module")
def unbroken_process(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("gpu-unbroken-process")
    result = run(Cluster(tmp), gpu_process_job(tmp / "hash.txt"), None)
    assert result.report["recoveries"] == []
    assert "backend: nccl on cuda:0" in result.logs()
    return (tmp / "hash.txt").read_text().strip()


def test_nccl_ddp_through_a_crash_a_chip_fault_a_lost_node_and_a_hang_ends_bit_identical(
    cluster: Cluster, unbroken: str
) -> None:
    out = cluster.dir / "hash.txt"
    result = run(cluster, gpu_job(out), DDP_FAULTS)
    assert result.actions == ["job-reschedule", "in-place", "pod-reschedule", "hang-restart"]
    assert all(r["outcome"] == "succeeded" for r in result.report["recoveries"])
    assert out.read_text().strip() == unbroken
    # what the resumes loaded held the GPU's random stream: dropout drew from it
    shared = next((cluster.state / "jobs").glob("*/shared/ckpt"))
    saved = CheckpointManager(shared, rank=0).load()
    assert saved is not None and "cuda" in saved.state["rng"], sorted(saved.state["rng"])


def test_nccl_process_levels_retry_in_place_and_reschedule_end_bit_identical(
    cluster: Cluster, unbroken_process: str
) -> None:
    out = cluster.dir / "hash.txt"
    faults = [
        {"kind": "memory-uce", "at_step": 25, "pod": 0, "code": "80E01801", "heals": True},
        {"kind": "process-exit", "at_step": 55, "pod": 1, "rank": 1, "exit_code": 1},
        {"kind": "node-down", "at_step": 85, "pod": 1},
    ]
    result = run(cluster, gpu_process_job(out), faults)
    assert result.actions == ["process-retry", "process-in-place", "process-reschedule"]
    assert all(r["outcome"] == "succeeded" for r in result.report["recoveries"])
    assert result.report["restarts_used"] == 0
    logs = result.logs()
    assert "retry at step" in logs and "rejoin at step" in logs
    assert out.read_text().strip() == unbroken_process
