"""The simulated job and cluster, and the fault that sends it to each recovery level.

Timings are a large cluster's, not a quick test's: heartbeats every 10 s (Kubernetes' node
status period; lost after 30 s of silence, and at once when its agent ends, as the embedded
cluster sees it), a 60 s hang window (relaunch's default is 30 minutes; its launchers then
sample the ranks' CPU every 12 s), no slow-pod detection. Every node has 8 chips and takes one pod of 8 ranks; two nodes stand by.
The fault strikes the last pod (not pod 0, whose rank 0 makes some faults job-level).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROCESS_LEVELS", "SIM_LEVELS", "WARM", "sim_job"]

RETRY = {"fault-tolerance/job-retry-num": "8"}
PROCESS_LABELS = {"process-recover-enable": "on", "pod-rescheduling": "on"}
PROCESS_ANNOTATIONS = {
    "recover-strategy": "retry,recover-in-place,recover,dump,exit",
    "wait-reschedule-timeout": "60",
}
HANG_S = 60
HEARTBEAT_S = 10.0

SIM_LEVELS: dict[str, tuple[dict[str, str], dict[str, str], dict[str, Any]]] = {
    # level -> (annotations, labels, the fault; its pod and rank are filled in)
    "process-retry": (
        {**RETRY, **PROCESS_ANNOTATIONS},
        PROCESS_LABELS,
        {"kind": "memory-uce", "chip": 0, "code": "80E01801", "heals": True},
    ),
    "process-in-place": (
        {**RETRY, **PROCESS_ANNOTATIONS},
        PROCESS_LABELS,
        {"kind": "process-exit", "exit_code": 1},
    ),
    "process-reschedule": (
        {**RETRY, **PROCESS_ANNOTATIONS},
        PROCESS_LABELS,
        {"kind": "node-down"},
    ),
    "in-place": (RETRY, {}, {"kind": "chip-fault", "chip": 0, "code": "80E18005", "heals": True}),
    "hang-restart": (
        {**RETRY, "fault-tolerance/hang-retry": "true"},
        {},
        {"kind": "hang"},
    ),
    "pod-reschedule": ({**RETRY, "fault-tolerance/pod-retry-num": "3"}, {}, {"kind": "node-down"}),
    "isolated-job-reschedule": (RETRY, {}, {"kind": "node-down"}),
    "job-reschedule": (
        {**RETRY, "fault-tolerance/job-unconditional-retry": "true"},
        {},
        {"kind": "process-exit", "exit_code": 1},
    ),
}


WARM = "+spare"
"""A level's variant with warm spares (`warm_spares: 1`), relaunch's best for the levels that
rebuild pods: every node keeps a standby launcher, and a rebuilt pod takes its node's (one
`Assume` on a connection it has; no new launcher connects and says hello)."""

for _level in ("pod-reschedule", "isolated-job-reschedule", "job-reschedule"):
    SIM_LEVELS[_level + WARM] = SIM_LEVELS[_level]

PROCESS_LEVELS = ("process-retry", "process-in-place", "process-reschedule")


def sim_job(
    pods: int, procs: int, level: str, step_s: float, lead_s: float | None, tail_s: float
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], int]:
    """The job, the cluster and the fault plan of one simulated run, and its steps in all: the
    fault comes `lead_s` into the job (by default once every pod has started and trained a
    while: 10 s, and a second for every 200 pods), the job ends `tail_s` after it (after its
    detection, for a hang)."""
    annotations, labels, fault = SIM_LEVELS[level]
    lead = 10 + pods / 200 if lead_s is None else lead_s
    at_step = max(1, int(lead / step_s))
    # a hang is found a hang window after it: the job still trains then, `tail_s` more after
    waits = HANG_S if fault["kind"] == "hang" else 0
    steps = at_step + max(1, int((waits + tail_s) / step_s))
    job = {
        "kind": "job",
        "metadata": {
            "name": "sim",
            "annotations": annotations,
            "labels": {"fault-scheduling": "grace", "grace-over-time": "1", **labels},
        },
        "spec": {
            "replicas": pods,
            "procs_per_pod": procs,
            "chips_per_pod": procs,
            "command": "python train.py",
            "hang_detect_seconds": HANG_S,
            "warm_spares": 1 if level.endswith(WARM) else 0,
        },
    }
    cluster = {
        "nodes": [{"name": f"node-{i}", "chips": procs} for i in range(pods + 2)],
        "heartbeat_interval_s": HEARTBEAT_S,
        "heartbeat_timeout_s": 3 * HEARTBEAT_S,
        "adopt_grace_s": 30,
        "slow_window_s": 0,
    }
    struck = {**fault, "pod": pods - 1, "at_step": at_step}
    if fault["kind"] in ("process-exit", "hang"):
        struck["rank"] = pods * procs - 1
    return job, cluster, [struck], steps
