"""The baseline: the same DDP script under `torchrun --max-restarts=N` (from the installed torch),
two agents standing for two pods, measured from the script's own timeline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from relaunch.cluster.local import free_port, kill_tree
from relaunch_bench import timeline
from relaunch_bench.jobs import DDP, FAULT_STEP, GPU_STEP_S, median
from relaunch_bench.timeline import Sample

Agents = list[tuple[subprocess.Popen[bytes], Any]]
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""What torchrun runs with here (written in bench.json)."""


def start(
    tmp: Path,
    timeline_path: Path,
    extra: list[str],
    max_restarts: int = 3,
    steps: int = 60,
    procs: int = 2,
    device: str = "cpu",
    script: Path = DDP,
) -> Agents:
    """The DDP script (or `script`, which takes the same arguments) under torchrun
    --max-restarts=N: two agents (pods) of `procs` workers.
    `device` cuda: on the GPUs over NCCL, each agent a host of its own to NCCL (NCCL_HOSTID), as
    relaunch's nodes are, so that the agents' ranks may share a GPU."""
    port = free_port()
    agents = []
    if device != "cpu":
        extra = [*extra, "--device", device]
    for node_rank in range(2):
        env = {
            **os.environ,
            **ENV,
            "PYTHONUNBUFFERED": "1",
            "NCCL_HOSTID": f"torchrun-node-{node_rank}",
        }
        args = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(procs),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            str(script), "--steps", str(steps), "--ckpt-every", "5", "--ckpt-dir", str(tmp / "ckpt"),
            "--timeline", str(timeline_path), *extra,
        ]  # fmt: skip
        log = open(tmp / f"torchrun-{node_rank}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True
        )
        agents.append((proc, log))
    return agents


def stop(agents: Agents, wait_s: float = 0.0) -> bool:
    """Wait up to `wait_s` for both agents to finish; kill whatever is left. True if both exited 0."""
    ok = True
    deadline = time.time() + wait_s
    for proc, log in agents:
        try:
            ok = proc.wait(timeout=max(0.01, deadline - time.time())) == 0 and ok
        except subprocess.TimeoutExpired:
            ok = False
        kill_tree(proc.pid)  # torchrun's workers run in sessions of their own
        proc.wait()
        log.close()
    return ok


def crash_once(
    tmp: Path, procs: int = 2, device: str = "cpu", step_s: float | None = None
) -> Sample:
    """One crash of the last rank at FAULT_STEP; MTTR from the timeline. `step_s`: the DDP
    script's step time (default: its own on the CPU, GPU_STEP_S on a GPU, as relaunch's)."""
    path = tmp / "timeline.txt"
    crash = ["--crash-at-step", str(FAULT_STEP), "--crash-rank", str(2 * procs - 1)]
    step_s = GPU_STEP_S if step_s is None and device != "cpu" else step_s
    if step_s is not None:
        crash += ["--step-seconds", str(step_s)]
    ok = stop(start(tmp, path, crash, procs=procs, device=device), wait_s=240)
    measured = timeline.crash_sample(path)
    if measured is None or not ok:
        return Sample(
            False, note="torchrun did not finish" if not ok else "no crash in the timeline"
        )
    return measured


def hang_row(limit: float, tmp: Path, procs: int = 2) -> dict[str, Any]:
    """A rank stopped with SIGSTOP under torchrun, which has no hang detector: does anything
    restart the job within `limit` s? (The script's gloo group times out after 60 s.)"""
    path = tmp / "timeline.txt"
    extra = ["--hang-at-step", str(FAULT_STEP), "--crash-rank", str(2 * procs - 1)]
    agents = start(tmp, path, extra, procs=procs)
    hung_at = _wait_past_hang(path, limit)
    stop(agents)
    row: dict[str, Any] = {
        "system": "torchrun",
        "workload": "ddp",
        "script": "exits on SIGTERM",
        "window_s": None,
        "detected": False,
        "detect_s": None,
        "mttr_s": None,
    }
    if hung_at is None:
        return {**row, "note": "the hang never happened"}
    events = timeline.read(path)
    restart = next((t for e, _, t in events if e == "start" and t > hung_at), None)
    step = next((t for e, _, t in events if e == "step" and t > hung_at), None)
    if restart is None or restart - hung_at > limit:
        return {**row, "note": f"not detected within {limit:g} s"}
    return {
        **row,
        "detected": True,
        "detect_s": round(restart - hung_at, 3),
        "mttr_s": None if step is None else round(step - hung_at, 3),
        "note": "restarted",
    }


def _wait_past_hang(path: Path, limit: float) -> float | None:
    """When the rank hung (None if it never did within 120 s), once `limit` s have passed since
    or the job restarted."""
    deadline = time.time() + 120
    hung_at = None
    while time.time() < deadline:
        events = timeline.read(path)
        hung_at = next((t for e, _, t in events if e == "hang"), hung_at)
        if hung_at is not None and (
            time.time() - hung_at > limit or any(e == "start" and t > hung_at for e, _, t in events)
        ):
            break
        time.sleep(0.2)
    return hung_at


def reliability_row(tmp: Path, crashes: int) -> dict[str, Any]:
    """The DDP script under torchrun --max-restarts=`crashes`, rank 3 exiting 1 once in each of
    the first `crashes` attempts; a restart that makes no step within 90 s counts as failed."""
    path = tmp / "timeline.txt"
    crash = ["--crash-every", "10", "--crash-attempts", str(crashes)]
    agents = start(tmp, path, crash, max_restarts=crashes, steps=10 * crashes + 20)
    stalled = False
    while any(p.poll() is None for p, _ in agents):
        last = max((t for _, _, t in timeline.read(path)), default=time.time())
        if time.time() - last > 90:
            stalled = True
            break
        time.sleep(0.5)
    ok = stop(agents, wait_s=5) and not stalled
    events = timeline.read(path)
    crash_times = [t for e, _, t in events if e == "crash"]
    mttrs = [
        min(t for e, _, t in events if e == "step" and t > at) - at
        for at in crash_times
        if any(e == "step" and t > at for e, _, t in events)
    ]
    return {
        "system": "torchrun",
        "level": "job-reschedule",
        "workload": "ddp",
        "jobs": 1,
        "injected": len(crash_times),
        "recovered": len(mttrs),
        "other_actions": [],
        "job_succeeded": ok,
        "median_mttr_s": median(mttrs),
        "ettr": None,  # torchrun records no goodput
        "lost_s": None,
        "median_capture_s": None,
    }
