"""Small builders shared by the tests: jobs from annotations and labels, clusters, faults."""

from __future__ import annotations

from typing import Any

from relaunch.faults import Fault, FaultKind
from relaunch.policy import ClusterView, JobHistory, PodView
from relaunch.spec import JobSpec, RecoverySettings, parse_job


def job(
    annotations: dict[str, Any] | None = None,
    labels: dict[str, Any] | None = None,
    **spec: Any,
) -> JobSpec:
    data = {
        "kind": "job",
        "metadata": {"name": "t", "annotations": annotations or {}, "labels": labels or {}},
        "spec": {"command": "python train.py", **spec},
    }
    return parse_job(data)


def settings(
    annotations: dict[str, Any] | None = None,
    labels: dict[str, Any] | None = None,
    **spec: Any,
) -> RecoverySettings:
    return job(annotations, labels, **spec).recovery


MODELARTS_ALL = {
    "fault-tolerance/job-retry-num": "8",
    "fault-tolerance/job-unconditional-retry": "true",
    "fault-tolerance/hang-retry": "true",
    "fault-tolerance/pod-retry-num": "3",
}
AUTO = {"fault-tolerance/job-retry-num": "8"}
PROCESS_LABELS = {"fault-scheduling": "grace", "process-recover-enable": "on"}


def process_settings(strategies: str, **extra: Any) -> RecoverySettings:
    return settings({**MODELARTS_ALL, "recover-strategy": strategies}, PROCESS_LABELS, **extra)


def cluster(pods: int = 2, standby: int = 1, **facts: Any) -> ClusterView:
    """Pods 0..n-1 on node-0..node-(n-1), rank 0 in pod 0; standby nodes after them."""
    return ClusterView(
        pods=tuple(PodView(i, f"node-{i}", holds_rank0=i == 0) for i in range(pods)),
        standby_nodes=tuple(f"node-{pods + i}" for i in range(standby)),
        **facts,
    )


def history(pods: int = 2) -> JobHistory:
    return JobHistory(pods=pods)


def crash(pod: int = 1, at: float = 0.0, code: int = 1) -> Fault:
    return Fault(
        FaultKind.PROCESS_EXIT, at, node=f"node-{pod}", pod=pod, rank=2 * pod, exit_code=code
    )


def chip(code: str, node: str = "node-1", chip_index: int = 0, at: float = 0.0, **kw: Any) -> Fault:
    return Fault(FaultKind.CHIP, at, node=node, chip=chip_index, code=code, **kw)


def node_lost(node: str = "node-1", at: float = 0.0) -> Fault:
    return Fault(FaultKind.NODE_LOST, at, node=node)


def hang(at: float = 0.0) -> Fault:
    return Fault(FaultKind.HANG, at)


def uce(node: str = "node-1", at: float = 0.0) -> Fault:
    return Fault(FaultKind.MEMORY_UCE, at, node=node, chip=0, code="80E01801")


def network(node: str = "node-1", duration: float | None = 60.0, at: float = 0.0) -> Fault:
    return Fault(FaultKind.NETWORK, at, node=node, duration_s=duration)


# Codes from the default table, by what they exercise.
MAJOR = "80E18005"  # RestartNPU -> Major: self-healable
MINOR = "80E01801"  # RestartBusiness -> Minor: self-healable
CRITICAL = "80E3A201"  # SeparateNPU -> Critical
USER = "80C98002"  # RestartRequest, user-induced
WARNING = "81078603"  # NotHandleFault -> Warning
