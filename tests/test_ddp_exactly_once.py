"""Exactly once: the PyTorch DDP example hit by a crash, a chip fault, a lost node and a hang ends
with bit-identical parameters to an unbroken run. (The same promise with dying-gasp dumps instead
of periodic checkpoints is tested on a harder input, a script with dropout and Adam written from
the SDK guide alone: tests/test_sdk_bit_identical.py.)"""

from __future__ import annotations

import re

from tests.runtime import DDP_CLUSTER as CLUSTER
from tests.runtime import DDP_FAULTS as FAULTS
from tests.runtime import Cluster, ddp_job


def resume_steps(logs: str, rank: int = 0) -> list[int]:
    return [int(m) for m in re.findall(rf"start: rank {rank}/2 .* resume_step=(\d+)", logs)]


def test_ddp_with_every_fault_ends_bit_identical(cluster: Cluster, unbroken: str) -> None:
    out = cluster.dir / "hash.txt"
    result = cluster.run(ddp_job(out, 10), FAULTS, CLUSTER, timeout=400, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["job-reschedule", "in-place", "pod-reschedule", "hang-restart"]
    assert all(r["outcome"] == "succeeded" for r in result.report["recoveries"])
    assert out.read_text().strip() == unbroken
    assert len(resume_steps(result.logs())) == 5
