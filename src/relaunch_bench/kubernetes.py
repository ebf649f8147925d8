"""Kubernetes, side by side: a crash and a lost node on a trial Kubernetes cluster of three nodes
(relaunch.cluster.kubernetes.trial: the real control plane, relaunch's agent as each node's
kubelet), under relaunch (`relaunch run --engine kubernetes`, two pods and a standby node) and
under Kubernetes' own answer: an Indexed Job of two pods with `restartPolicy: Never`, a
`podFailurePolicy` (a pod's exit counts against `backoffLimit`, a disruption does not) and the
real Job controller recreating what fails. Both run the same script (plain_ddp.py, a
checkpoint every 5 steps) and take the same fault at the same step: rank 1 crashes (the
script's fault series), or the node of rank 1's pod dies (its agent and every process of its
pods killed, when rank 0 reports FAULT_STEP). One ruler for both: the stall from the fault to
the first step after it, off the script's timeline (`timeline.read`).

The Indexed Job is given Kubernetes' fastest settings a user would pick for failover: its pods
tolerate an unreachable or not-ready node for only TOLERATE_S (300 s by default), so that the
taint manager evicts them soon after the node is marked NotReady.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relaunch.cluster.kubernetes.objects import ISOLATED_TAINT, POD_LABEL
from relaunch.cluster.kubernetes.trial import TrialKubernetes
from relaunch.cluster.local import free_port
from relaunch.errors import EngineError
from relaunch_bench import timeline
from relaunch_bench.jobs import FAULT_STEP, Progress, median, two_pod_job
from relaunch_bench.peer_runs import PLAIN_DDP, PeerSample, _launcher_sample

__all__ = ["JOB", "kubernetes_rows", "row_of"]

NODES = ["n1", "n2", "n3"]
JOB = "Indexed Job"
"""Kubernetes' own answer, as the rows name it."""
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
STEPS = 80
TIMEOUT_S = 150.0
TOLERATE_S = 5
NODE_GRACE_S = 10.0
"""How long a Node's Lease may go unrenewed before the controller manager marks it NotReady
(`--node-monitor-grace-period`: 40 s by default on a real cluster)."""
CLUSTER = {
    "chips_per_node": 2,
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.5,
    "adopt_grace_s": 10,
}


def kubernetes_rows(say: Progress, repeats: int = 1) -> list[dict[str, Any]]:
    """Per system and fault, `repeats` samples on one trial Kubernetes cluster (the systems
    taking turns), as one row: the median stall of those that recovered and its spread (rows
    with a note where there is no cluster: the control plane not built)."""
    home = Path(tempfile.mkdtemp(prefix="relaunch-bench-k8s-"))
    trial = TrialKubernetes(home / "k8s", NODES, node_grace_s=NODE_GRACE_S)
    try:
        trial.start(progress=lambda text: say(f"kubernetes: {text}"))
    except EngineError as error:
        shutil.rmtree(home, ignore_errors=True)
        say(f"kubernetes: skipped: {error}")
        return [{"system": s, "fault": f, "ok": False, "note": str(error)}
                for f in ("crash", "lost-node") for s in ("relaunch", JOB)]  # fmt: skip
    samples: dict[tuple[str, str], list[PeerSample]] = {}
    try:
        for fault in ("crash", "lost-node"):
            for run in range(repeats):
                for system in ("relaunch", JOB):
                    tmp = home / f"{system.replace(' ', '-')}-{fault}-{run}"
                    tmp.mkdir()
                    sample = _once(trial, system, fault, tmp)
                    say(f"kubernetes: {system} {fault} ({run + 1}/{repeats}): "
                        f"{sample.stall_s} s {sample.note}")  # fmt: skip
                    samples.setdefault((system, fault), []).append(sample)
    finally:
        trial.stop()
        shutil.rmtree(home, ignore_errors=True)
    return [row_of(system, fault, found) for (system, fault), found in samples.items()]


def row_of(system: str, fault: str, samples: list[PeerSample]) -> dict[str, Any]:
    """One row of a system's samples of one fault: the median stall of those that recovered,
    their spread, and why the others did not."""
    ok = [s for s in samples if s.ok and s.stall_s is not None]
    stalls = sorted(s.stall_s for s in ok if s.stall_s is not None)
    lost = [s.lost_steps for s in ok if s.lost_steps is not None]
    notes = list(dict.fromkeys(s.note for s in samples if not s.ok and s.note))
    return {
        "system": system,
        "fault": fault,
        "ok": bool(ok),
        "recovered": f"{len(ok)}/{len(samples)}",
        "stall_s": median(stalls),
        "stall_range": f"{stalls[0]}-{stalls[-1]}" if len(stalls) > 1 else None,
        "stalls": stalls,
        "lost_steps": median([float(n) for n in lost]),
        "note": "; ".join(notes),
    }


def _once(trial: TrialKubernetes, system: str, fault: str, tmp: Path) -> PeerSample:
    line = tmp / "timeline.txt"
    script = [str(PLAIN_DDP), "--steps", str(STEPS), "--ckpt-dir", str(tmp / "ckpt"),
              "--timeline", str(line), "--fault-rank", "1"]  # fmt: skip
    if fault == "crash":
        script += ["--faults", f"{FAULT_STEP}:crash"]
    if system == "relaunch":
        run: subprocess.Popen[bytes] | None = _relaunch(trial, tmp, script)
        rank1 = f"{POD_LABEL}=1"
    else:
        trial.plane.kubectl("apply", "-f", str(_indexed_job(tmp, script)))
        run, rank1 = None, f"{INDEX_LABEL}=1"
    killed, lost = fault != "lost-node", ""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not _ended(trial, run):
            if not killed and _step(line) >= FAULT_STEP:
                lost = _node_of(trial, rank1)
                with open(line, "a") as marks:  # the strike, on the script's own ruler
                    marks.write(f"crash {_step(line)} {time.time():.6f}\n")
                trial.kill_agent(lost)  # takes a moment: the ruler starts before it
                killed = True
            if time.monotonic() > deadline:
                sample = _launcher_sample(line, "crash", False)
                if sample.ok:
                    return sample
                return PeerSample(False, note=f"not restored within {TIMEOUT_S:g} s: "
                                  + _what_holds(trial, rank1, lost))  # fmt: skip
            time.sleep(0.05)
        finished = run.returncode == 0 if run is not None else _job_complete(trial)
        return _launcher_sample(line, "crash", finished)
    finally:
        if run is not None and run.poll() is None:
            run.kill()
            run.wait()
        _clean(trial, lost)


def _relaunch(trial: TrialKubernetes, tmp: Path, script: list[str]) -> subprocess.Popen[bytes]:
    job = two_pod_job("k8s-bench", [sys.executable, *script])
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "cluster.json").write_text(json.dumps(CLUSTER))
    with open(tmp / "relaunch.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "relaunch", "run", str(tmp / "job.json"), "--engine",
             "kubernetes", "--kubeconfig", str(trial.controller_kubeconfig), "--cluster",
             str(tmp / "cluster.json"), "--state-dir", str(tmp / "state"),
             "--startup-seconds", "60", "--quiet"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
        )  # fmt: skip


def _indexed_job(tmp: Path, script: list[str]) -> Path:
    """The Indexed Job of the same script: rank = the pod's completion index (the downward
    API), rank 0's store on the machine's loopback, where every trial node's pods run."""
    index = f"metadata.annotations['{INDEX_LABEL}']"
    env = [
        {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": index}}},
        {"name": "LOCAL_RANK", "value": "0"},
        {"name": "WORLD_SIZE", "value": "2"},
        {"name": "MASTER_ADDR", "value": "127.0.0.1"},
        {"name": "MASTER_PORT", "value": str(free_port())},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    tolerate = [{"key": f"node.kubernetes.io/{why}", "operator": "Exists",
                 "effect": "NoExecute", "tolerationSeconds": TOLERATE_S}
                for why in ("unreachable", "not-ready")]  # fmt: skip
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "k8s-bench"},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": 6,
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                    {"action": "Count", "onExitCodes": {"operator": "NotIn", "values": [0]}},
                ]
            },
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "tolerations": tolerate,
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "python",
                            "command": [sys.executable, *script],
                            "env": env,
                            "workingDir": str(tmp),
                            "resources": {"limits": {"relaunch.io/chip": "2"}},
                        }
                    ],
                }
            },
        },
    }
    path = tmp / "indexed-job.json"
    path.write_text(json.dumps(job))
    return path


def _pods(trial: TrialKubernetes, selector: str = "") -> list[dict[str, Any]]:
    which = ["-l", selector] if selector else []
    listed = json.loads(trial.plane.kubectl("get", "pods", *which, "-o", "json"))
    items: list[dict[str, Any]] = listed["items"]
    return items


def _node_of(trial: TrialKubernetes, selector: str) -> str:
    """The node of the running pod of `selector` (rank 1's)."""
    running = [p for p in _pods(trial, selector) if p["status"].get("phase") == "Running"]
    return str(running[-1]["spec"]["nodeName"])


def _what_holds(trial: TrialKubernetes, selector: str, lost: str) -> str:
    """What rank 1's pods are to the API server at the end, in words (no names: the same
    outcome reads the same in every run)."""
    said = []
    for pod in _pods(trial, selector):
        state = pod["status"].get("phase", "?")
        if pod["metadata"].get("deletionTimestamp"):
            state = f"Terminating ({state})"
        where = "the lost node" if lost and pod["spec"].get("nodeName") == lost else "a live node"
        said.append(f"{state} on {where}")
    return "rank 1's pods: " + ", ".join(dict.fromkeys(said))


def _step(line: Path) -> int:
    return max((s for e, s, _ in timeline.read(line) if e == "step"), default=0)


def _ended(trial: TrialKubernetes, run: subprocess.Popen[bytes] | None) -> bool:
    if run is not None:
        return run.poll() is not None
    status = json.loads(trial.plane.kubectl("get", "job", "k8s-bench", "-o", "json"))["status"]
    return any(
        c["type"] in ("Complete", "Failed") and c["status"] == "True"
        for c in status.get("conditions", [])
    )


def _job_complete(trial: TrialKubernetes) -> bool:
    status = json.loads(trial.plane.kubectl("get", "job", "k8s-bench", "-o", "json"))["status"]
    return any(c["type"] == "Complete" for c in status.get("conditions", []))


def _clean(trial: TrialKubernetes, lost: str) -> None:
    """The Job and every pod gone (a lost node's at once: no kubelet answers for them), the
    lost node back and Ready, relaunch's isolation of it released."""
    kubectl = trial.plane.kubectl
    kubectl("delete", "job", "k8s-bench", "--ignore-not-found", "--wait=false", check=False)
    kubectl("delete", "pods", "--all", "--force", "--grace-period=0", "--ignore-not-found")
    if lost:
        trial.start_agent(lost)
        kubectl("taint", "nodes", lost, f"{ISOLATED_TAINT}-", check=False)
    deadline = time.monotonic() + 120
    while not (set(NODES) <= trial.ready_nodes() and not _pods(trial)):
        if time.monotonic() > deadline:
            raise EngineError("the trial cluster did not come back between two runs")
        time.sleep(0.2)
