"""Slurm, side by side: a crash and a lost node inside one Slurm allocation of three nodes, under
relaunch (`relaunch run --engine slurm`, two pods and a standby node) and under NVIDIA's
`ft_launcher` as its deployment guide starts it under Slurm (one per node, `srun
--ntasks-per-node=1`, `--nnodes 2:3` so that the third node joins as the spare), on a trial
Slurm cluster of this machine (relaunch.cluster.slurm_trial). Both run the same script
(plain_ddp.py: a step every STEP_S, a checkpoint every 5) and take the same fault at the same
step: rank 1 crashes (the script's `--crash-at-step`), or node n2 dies (its slurmd and every
process in its namespace killed, when rank 0 reports FAULT_STEP). One ruler for both: the stall
from the fault to the first step after it, off the script's timeline (`timeline.read`).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relaunch.cluster.local import free_port
from relaunch.cluster.slurm_trial import TrialSlurm, unavailable
from relaunch_bench import timeline
from relaunch_bench.jobs import FAULT_STEP, Progress, two_pod_job
from relaunch_bench.peer_runs import (
    NVRX_HEARTBEAT_S,
    PLAIN_DDP,
    PeerSample,
    _launcher_sample,
    peer_environment,
    peer_python,
)

__all__ = ["slurm_rows"]

NODES = ["n1", "n2", "n3"]
LOST = "n2"
"""The node a lost-node run kills: neither system's rendezvous or controller host (n1)."""
STEPS = 80
TIMEOUT_S = 150.0
CLUSTER = {
    "chips_per_node": 2,
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.5,
    "adopt_grace_s": 10,
    "pod_lease_s": 1.5,
}
"""A silent node's pods stop once they have heard nothing from the controller for a few
heartbeats (`pod_lease_s`, R-14), not the 10 s a resumed controller has to adopt them."""


def slurm_rows(say: Progress) -> list[dict[str, Any]]:
    """One sample per system and fault, on one trial Slurm cluster (rows with a note where a
    system could not run: no Slurm, not root, NVRx not installed)."""
    why = unavailable()
    if why is not None:
        say(f"slurm: skipped: {why}")
        return [{"system": s, "fault": f, "ok": False, "note": why} for s in ("relaunch", "NVRx")
                for f in ("crash", "lost-node")]  # fmt: skip
    home = Path(tempfile.mkdtemp(prefix="relaunch-bench-slurm-"))
    trial = TrialSlurm(home / "slurm", NODES).start()
    rows = []
    try:
        nvrx = peer_python("nvrx")
        for fault in ("crash", "lost-node"):
            for system in ("relaunch", "NVRx"):
                tmp = home / f"{system}-{fault}"
                tmp.mkdir()
                if system == "NVRx" and isinstance(nvrx, str):
                    sample = PeerSample(False, note=nvrx)
                else:
                    sample = _once(trial, system, fault, tmp, nvrx)
                    _node_back(trial)
                say(f"slurm: {system} {fault}: {sample.stall_s} s {sample.note}")
                rows.append({"system": system, "fault": fault, **sample.__dict__})
    finally:
        trial.stop()
        shutil.rmtree(home, ignore_errors=True)
    return rows


def _once(trial: TrialSlurm, system: str, fault: str, tmp: Path, nvrx: Path | str) -> PeerSample:
    line = tmp / "timeline.txt"
    script = ["--steps", str(STEPS), "--ckpt-dir", str(tmp / "ckpt"), "--timeline", str(line)]
    if fault == "crash":
        script += ["--crash-at-step", str(FAULT_STEP)]
    if system == "relaunch":
        body = _relaunch_body(tmp, script)
    else:
        assert isinstance(nvrx, Path)
        body = _nvrx_body(trial, nvrx, script)
    batch = tmp / "job.sh"
    batch.write_text(
        f"#!/bin/bash\n#SBATCH --nodes={len(NODES)}\n#SBATCH --no-kill\n"
        f"#SBATCH --output={tmp / 'out.txt'}\nexport GLOO_SOCKET_IFNAME=mgmt0\n"
        f"cd {tmp}\n{body}\n"
    )
    job_id = trial.slurm(["sbatch", "--parsable", str(batch)]).stdout.strip().split(";")[0]
    deadline = time.monotonic() + TIMEOUT_S
    killed = fault != "lost-node"
    while not _ended(trial, job_id):
        if not killed and _step(line) >= FAULT_STEP:
            with open(line, "a") as marks:  # the strike, on the script's own ruler
                marks.write(f"crash {_step(line)} {time.time():.6f}\n")
            trial.kill_node(LOST)  # takes a moment: the ruler starts before it
            killed = True
        if time.monotonic() > deadline:
            trial.slurm(["scancel", job_id], check=False)
            return PeerSample(False, note=f"did not end within {TIMEOUT_S:g} s")
        time.sleep(0.05)
    finished = _state(trial, job_id) == "COMPLETED"
    if system != "relaunch":
        return _launcher_sample(line, "crash", finished, parts=True)
    recoveries = _recoveries(tmp / "report.json")
    detect = recoveries[0].get("detect_s") if recoveries else None
    sample = _launcher_sample(line, "crash", finished, parts=True, detect_s=detect)
    sample.note = ", ".join(f"{r['action']} {r['outcome']}" for r in recoveries)
    return sample


def _recoveries(report: Path) -> list[dict[str, Any]]:
    """relaunch's records of the run (its --report), empty where it wrote none."""
    try:
        found: list[dict[str, Any]] = json.loads(report.read_text())["recoveries"]
    except (OSError, ValueError, KeyError):
        return []
    return found


def _relaunch_body(tmp: Path, script: list[str]) -> str:
    job = two_pod_job("slurm-bench", [sys.executable, str(PLAIN_DDP), *script])
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "cluster.json").write_text(json.dumps(CLUSTER))
    return (
        f"{sys.executable} -m relaunch run --engine slurm {tmp / 'job.json'} --cluster "
        f"{tmp / 'cluster.json'} --state-dir {tmp / 'state'} --report {tmp / 'report.json'} "
        "--startup-seconds 60 --quiet"
    )


def _nvrx_body(trial: TrialSlurm, python: Path, script: list[str]) -> str:
    """ft_launcher on every node, started by srun, rendezvous on the first node's address."""
    assert trial.network is not None
    head = f"{trial.network.layout.mgmt_address(NODES[0])}:{free_port()}"
    env = peer_environment(python.parent)
    launcher = [
        str(python.parent / "ft_launcher"), "--nnodes", f"2:{len(NODES)}",
        "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", head,
        "--rdzv-conf", "is_host=$HOST", "--local-addr", "$ADDR", "--rdzv-id", "bench",
        "--max-restarts", "3",
        "--monitor-interval", "0.1", "--ft-enable-nic-monitor", "false",
        "--ft-initial-rank-heartbeat-timeout", "60",
        "--ft-rank-heartbeat-timeout", str(NVRX_HEARTBEAT_S), str(PLAIN_DDP), "--nvrx", *script,
    ]  # fmt: skip
    # the first task hosts the rendezvous (its node's address is the endpoint), and each node's
    # address is its own: said outright, as the trial's nodes share one host name that resolves
    # to none of their addresses (on a real cluster each node's name resolves to its own)
    task = (
        f"export PATH={env['PATH']} PYTHONUNBUFFERED=1; "
        "if [ $SLURM_PROCID -eq 0 ]; then HOST=1; else HOST=0; fi; "
        "ADDR=$(ip -4 -o addr show mgmt0 | awk '\\''{print $4}'\\'' | cut -d/ -f1); exec "
        + " ".join(launcher)
    )
    return (
        f"srun --ntasks={len(NODES)} --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 "
        f"bash -c '{task}'"
    )


def _step(line: Path) -> int:
    return max((s for e, s, _ in timeline.read(line) if e == "step"), default=0)


def _state(trial: TrialSlurm, job_id: str) -> str:
    said = trial.slurm(["scontrol", "show", "job", "-o", job_id], check=False).stdout
    return next((f.split("=", 1)[1] for f in said.split() if f.startswith("JobState=")), "")


def _ended(trial: TrialSlurm, job_id: str) -> bool:
    return _state(trial, job_id) not in ("", "PENDING", "RUNNING", "CONFIGURING", "COMPLETING")


def _node_back(trial: TrialSlurm) -> None:
    """The lost node started again and returned to service, drained nodes resumed."""
    trial.start_node(LOST)
    for node in NODES:
        trial.slurm(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
    trial.wait_idle()
