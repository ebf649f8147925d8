"""The operations on jobs and nodes, once, for the command line and the API alike: submit a job
(checked fully first), find one, stop one, add faults to one, cordon or release a node.

Errors a user can act on are RelaunchErrors: InputError (and its kinds) for what is invalid,
NotFound and Ended for what the state directory does not allow.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaunch.cluster.config import ClusterConfig, parse_cluster
from relaunch.errors import FaultPlanError, NoRoom, Problem, RelaunchError, SpecError
from relaunch.faults import DEFAULT_TABLE, EscalationRules, FaultCodeTable
from relaunch.faults.plan import check_plan, parse_plan
from relaunch.files import load_fault_table
from relaunch.policy.placement import NodeCapacity, initial_placement, slots
from relaunch.protocol.layout import StateDir
from relaunch.spec import JobSpec, parse_job
from relaunch.store import JobRow, JobStatus, NodeRow, NodeState, PodRow, Store

__all__ = [
    "Ended",
    "NotFound",
    "Submission",
    "add_faults",
    "check_plan_fits",
    "cordon",
    "create_pods",
    "find_job",
    "plan_entries",
    "release",
    "stop_job",
    "stored_job",
    "submit",
    "table_from",
]


class NotFound(RelaunchError):
    """No such job or node."""


class Ended(RelaunchError):
    """The job has ended: it cannot be stopped or given faults."""


def table_from(path: str | Path | None) -> tuple[FaultCodeTable, EscalationRules]:
    if path is None:
        return DEFAULT_TABLE, EscalationRules()
    loaded = load_fault_table(Path(path))
    return DEFAULT_TABLE.overridden_by(loaded.rows), loaded.escalation or EscalationRules()


def plan_entries(data: Any, source: str) -> list[dict[str, Any]]:
    """A fault plan's entries as stored, after checking each (FaultPlanError otherwise)."""
    if data is None:
        return []
    parse_plan(data, source=source)
    entries = data.get("faults", []) if isinstance(data, Mapping) else data
    return [dict(e) for e in entries or []]


def check_plan_fits(
    entries: Sequence[Mapping[str, Any]], job: JobSpec, cluster: ClusterConfig, source: str
) -> None:
    """FaultPlanError naming every entry that cannot hit its target in this job and cluster."""
    problems = check_plan(parse_plan(list(entries), source=source), job, cluster)
    if problems:
        raise FaultPlanError(source, problems)


@dataclass(frozen=True)
class Submission:
    """Everything a runner needs to run a job later, as the store keeps it."""

    raw: Any
    source: str
    cwd: str
    cluster: Any = None
    plan: Sequence[Mapping[str, Any]] = ()
    project: str = "default"
    fault_table: str | None = None
    startup_s: float | None = None
    engine: Mapping[str, Any] | None = None
    """None: the embedded cluster; {"kind": "ray", "address": ..., "select": ...}: Ray."""
    plan_source: str = ""
    """Where the fault plan came from, for its problems (default: the job's source)."""


def submit(store: Store, submission: Submission, now: float) -> int:
    """Check a job fully and queue it as Pending; InputError lists every problem."""
    job = parse_job(submission.raw, source=submission.source)
    cluster = parse_cluster(submission.cluster, source="cluster settings")
    if submission.fault_table is not None:
        table_from(submission.fault_table)
    _check_fits(job, cluster, submission.source)
    if not submission.engine:
        _check_working_dir(job, submission.cwd, submission.source)
    plan_source = submission.plan_source or f"{submission.source}: fault plan"
    check_plan_fits(submission.plan, job, cluster, plan_source)
    stored = {
        "raw": submission.raw,
        "source": submission.source,
        "cwd": submission.cwd,
        "cluster": submission.cluster,
        "fault_table": submission.fault_table,
        "startup_s": submission.startup_s,
        "engine": dict(submission.engine) if submission.engine else None,
    }
    return store.create_job(job.name, stored, list(submission.plan), now, submission.project)


def _check_fits(job: JobSpec, cluster: ClusterConfig, source: str) -> None:
    room = sum(
        (n.chips // job.chips_per_pod if job.chips_per_pod else 1)
        for n in cluster.nodes
        if n.chips >= job.chips_per_pod
    )
    if room < job.replicas:
        raise SpecError(
            source,
            [
                Problem(
                    "spec.replicas",
                    job.replicas,
                    f"at most {room} pod(s) of {job.chips_per_pod} chip(s) fit on this cluster's "
                    f"{len(cluster.nodes)} node(s)",
                )
            ],
        )


def _check_working_dir(job: JobSpec, cwd: str, source: str) -> None:
    """A job whose working directory does not exist could never start: refused up front."""
    if job.working_dir is None:
        return
    where = Path(cwd, job.working_dir)
    if not where.is_dir():
        raise SpecError(
            source,
            [
                Problem(
                    "spec.working_dir",
                    job.working_dir,
                    f"an existing directory ({where} is not one; a relative path is taken from "
                    f"{cwd})",
                )
            ],
        )


def stored_job(row: JobRow) -> tuple[JobSpec, ClusterConfig]:
    """The job and cluster a stored job runs with (its working directory made absolute)."""
    job = parse_job(row.spec["raw"], source=row.spec["source"])
    cwd = row.spec.get("cwd") or os.getcwd()
    job = dataclasses.replace(job, working_dir=str(Path(cwd, job.working_dir or ".")))
    cluster = parse_cluster(row.spec.get("cluster"), source="stored cluster settings")
    return job, cluster


def create_pods(store: Store, directory: Path, job_id: int, spec: JobSpec) -> list[PodRow]:
    """Place a new job's pods in order on the first Ready nodes with chips for them."""
    nodes = [NodeCapacity(n.name, n.chips, n.schedulable) for n in store.nodes()]
    places = initial_placement(nodes, spec.replicas, spec.chips_per_pod)
    if places is None:
        room = len(slots([n for n in nodes if n.schedulable], spec.chips_per_pod, False))
        raise NoRoom(
            f"job {spec.name} needs {spec.replicas} pod(s) with {spec.chips_per_pod} chip(s) each; "
            f"the cluster has room for {room} on Ready nodes (see `relaunch nodes`)"
        )
    job_dir = StateDir(directory).job(job_id)
    pods = []
    for idx, node in enumerate(places):
        pod = PodRow(job_id, idx, node, 1, 1, 1, str(job_dir.pod(idx, 1).path))
        store.put_pod(pod)
        pods.append(pod)
    return pods


def find_job(store: Store, ref: str, project: str | None = None) -> JobRow:
    """A job by id (ASCII digits) or the newest with that name, in `project` if one is given."""
    row = store.find_job(ref)
    if row is None or (project is not None and row.project != project):
        where = f" in project {project!r}" if project is not None else ""
        raise NotFound(f"no job {ref!r}{where}")
    return row


def stop_job(store: Store, job: JobRow, reason: str, now: float) -> JobStatus:
    """A queued job stops at once; a running one is marked, and its controller stops it."""
    if job.status.ended:
        raise Ended(f"job {job.name} (id {job.id}) has ended ({job.status.value})")
    return store.request_stop(job.id, reason, now)


def add_faults(store: Store, job: JobRow, plan: Any, source: str) -> tuple[int, int]:
    """Fault-plan entries added to a job, once checked against it: (first index, count)."""
    if job.status.ended:
        raise Ended(f"job {job.name} (id {job.id}) has ended ({job.status.value})")
    entries = plan_entries(plan, source=source)
    if not entries:
        raise FaultPlanError(source, [Problem("faults", [], "at least one fault")])
    spec, cluster = stored_job(job)
    check_plan_fits([*job.plan, *entries], spec, cluster, source)  # numbered as they will be
    return store.append_plan(job.id, entries), len(entries)


def cordon(store: Store, name: str, now: float) -> NodeRow:
    """Isolate a node: no new pod goes there."""
    return _set_node(store, name, NodeState.ISOLATED, "cordoned by an operator", now)


def release(store: Store, name: str, now: float) -> NodeRow:
    """An isolated node is Ready again."""
    return _set_node(store, name, NodeState.READY, "released by an operator", now)


def _set_node(store: Store, name: str, state: NodeState, reason: str, now: float) -> NodeRow:
    if store.node(name) is None:
        raise NotFound(f"no node {name!r}")
    store.set_node_state(name, state, reason, now)
    node = store.node(name)
    assert node is not None
    return node
