"""The jobs the benchmarks run: the bundled training scripts, job specs, and one `relaunch run`
on a fresh embedded cluster."""

from __future__ import annotations

import json
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from relaunch.cluster.config import parse_cluster
from relaunch.cluster.local import kill_tree
from relaunch.cluster.nvml import simulate_args

Progress = Callable[[str], None]


def _script(name: str) -> Path:
    """A training script shipped in relaunch_bench/workloads (links to examples/ in the source
    tree, plain files in a wheel)."""
    path = Path(str(files("relaunch_bench") / "workloads" / name))
    if not path.is_file():
        raise FileNotFoundError(f"the benchmark workload {path} is missing from this install")
    return path


TOY = _script("train_toy.py")
"""examples/train_toy.py: light workers that report progress and checkpoint, no torch."""
DDP = _script("train_ddp.py")
"""examples/ddp/train_ddp.py: PyTorch DDP on gloo, with its own timeline of each phase."""
FAULT_STEP = 22
"""The step at which the MTTR runs inject their fault: between two checkpoints (the workloads
save every 5 steps). A fault during a save is passed over by process-level recovery (R-37), so
at a checkpoint step a process-level row measured the level below it."""
GPU_STEP_S = 0.25
"""The DDP script's step time on a GPU (`--step-seconds`, relaunch's and torchrun's runs alike):
its steps are so fast there that step FAULT_STEP came before the warm spares, which import torch
and start CUDA beside the job's own ranks, were ready, and a warm restart started cold."""
SAVE_FAULT_STEP = 20
"""A checkpoint step: where the `@save` rows put their fault, to measure a fault during a save."""


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def cluster(
    nodes: int, chips: int, heartbeat_s: float = 0.2, heartbeat_timeout_s: float = 1.5
) -> dict[str, Any]:
    """An embedded cluster with detection intervals short enough for a benchmark (by default:
    node loss in 1.5 s)."""
    return {
        "nodes": nodes,
        "chips_per_node": chips,
        "heartbeat_interval_s": heartbeat_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "adopt_grace_s": 10,
    }


def light_job(
    pods: int,
    annotations: dict[str, str],
    *,
    procs: int = 2,
    chips: int = 2,
    steps: int = 60,
    step_s: float = 0.03,
    hang_s: float = 2,
) -> dict[str, Any]:
    """The toy script in `pods` pods of `procs` processes, with a generous retry budget."""
    return {
        "kind": "job",
        "metadata": {
            "name": "bench-light",
            "annotations": {"fault-tolerance/job-retry-num": "40", **annotations},
            "labels": {"fault-scheduling": "grace", "grace-over-time": "1"},
        },
        "spec": {
            "replicas": pods,
            "procs_per_pod": procs,
            "chips_per_pod": chips,
            "command": f"python {TOY} --steps {steps} --step-seconds {step_s} --ckpt-every 5",
            "hang_detect_seconds": hang_s,
            "monitor_interval": 0.1,
        },
    }


def only_record(report: dict[str, Any] | None, action: str) -> dict[str, Any] | None:
    """The report's one recovery record, if it is `action` and it worked."""
    records = report["recoveries"] if report else []
    if len(records) != 1 or records[0]["action"] != action or records[0]["outcome"] != "succeeded":
        return None
    record: dict[str, Any] = records[0]
    return record


def run_job(
    tmp: Path,
    job: dict[str, Any],
    faults: list[dict[str, Any]],
    cluster: dict[str, Any],
    timeout: float = 600,
    during: Callable[[subprocess.Popen[bytes], Path], dict[str, Any]] | None = None,
    extra_args: tuple[str, ...] = (),
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`relaunch run` of one job with a fault plan on a fresh embedded cluster in `tmp`: its report
    (None if it failed) and whatever `during` measured while it ran."""
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp / "faults.yaml").write_text(yaml.safe_dump({"faults": faults}))
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    args = [
        sys.executable, "-m", "relaunch", "run", str(tmp / "job.yaml"), "--faults", str(tmp / "faults.yaml"),
        "--cluster", str(tmp / "cluster.yaml"), "--state-dir", str(tmp / "state"),
        "--report", str(tmp / "report.json"), "--startup-seconds", "120", "-q", *extra_args,
        *simulate_args(sum(n.chips for n in parse_cluster(cluster).nodes)),
    ]  # fmt: skip
    with open(tmp / "run.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        measured: dict[str, Any] = {}
        try:
            if during is not None:
                measured = during(proc, tmp / "state")
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    report_path = tmp / "report.json"
    if proc.returncode != 0 or not report_path.exists():
        return None, measured
    report: dict[str, Any] = json.loads(report_path.read_text())
    return report, measured


FAILED_RUNS_ENV = "RELAUNCH_BENCH_FAILED"
"""Where a failed bench run's directory is kept (default: the temporary directory's
relaunch-bench-failed/)."""

LAST_LINES = 8
"""How many of a failed run's last lines (its events, relaunch's records) are said."""


def keep_failed(tmp: Path, what: str) -> str:
    """A failed run's directory (its state: records, logs, the job and fault plan; its run's
    output) copied where it stays, and its last lines: what the bench says of the failure, so
    that the next one can be read. Sockets and other special files are left out."""
    root = Path(
        os.environ.get(FAILED_RUNS_ENV) or Path(tempfile.gettempdir()) / "relaunch-bench-failed"
    )
    name = "".join(ch if ch.isalnum() or ch in "-+." else "-" for ch in what)
    kept = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{os.getpid()}"
    shutil.copytree(tmp, kept, copy_function=_copy_regular, dirs_exist_ok=True)
    log = tmp / "run.log"
    lines = log.read_text(errors="replace").splitlines()[-LAST_LINES:] if log.exists() else []
    said = "; ".join(line.strip() for line in lines if line.strip())
    return f"kept in {kept}; last lines: {said or '(none)'}"


def _copy_regular(src: str, dst: str) -> str:
    if stat.S_ISREG(os.stat(src, follow_symlinks=False).st_mode):
        shutil.copy2(src, dst)
    return dst


def two_pod_job(name: str, command: list[str]) -> dict[str, Any]:
    """The engines' bench job: 2 pods of 1 rank on 2 chips each, `command` the rank's, with
    the job and pod retries that let every level the ladder tries run."""
    return {
        "kind": "job",
        "metadata": {
            "name": name,
            "annotations": {
                "fault-tolerance/job-retry-num": "4",
                "fault-tolerance/job-unconditional-retry": "true",
                "fault-tolerance/pod-retry-num": "2",
            },
        },
        "spec": {
            "replicas": 2,
            "procs_per_pod": 1,
            "chips_per_pod": 2,
            "command": " ".join(command),
            "monitor_interval": 0.1,
        },
    }
