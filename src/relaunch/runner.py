"""Submitting jobs and running them: one at a time per state directory, by whoever holds its lock.

`relaunch run` holds the lock in the foreground. `relaunch submit` and the server queue jobs as
Pending in the store and make sure a detached *runner* (`relaunch runner`) is alive; the runner
resumes a job whose controller died, then runs the pending ones in order, and exits when none is
left. Because the runner is its own process (its own session), a server restart never touches a
running job, and a runner killed mid-job is replaced by the next one, which resumes the job the
way `relaunch run --resume` does.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from relaunch.chaos import ChaosEntry, parse_plan
from relaunch.cluster import Engine
from relaunch.cluster.config import ClusterConfig, parse_cluster
from relaunch.cluster.local import LocalCluster
from relaunch.controller import Controller, RunOptions, create_pods
from relaunch.errors import InputError, Problem, SpecError
from relaunch.faults import DEFAULT_TABLE, EscalationRules, FaultCodeTable
from relaunch.files import load_fault_table
from relaunch.spec import JobSpec, parse_job
from relaunch.store import JobStatus, Store

__all__ = [
    "Submission",
    "abandon_unfinished",
    "could_not_start",
    "ensure_runner",
    "lock",
    "make_engine",
    "plan_entries",
    "run_job",
    "run_queue",
    "submit",
    "table_from",
]


def lock(directory: Path) -> IO[str]:
    """The state directory's run lock; RuntimeError if another run or runner holds it."""
    handle = open(directory / "run.lock", "a+")  # noqa: SIM115
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise RuntimeError(
            f"another `relaunch run` is using {directory}; wait for it or pass another --state-dir"
        ) from None
    return handle


def table_from(path: str | Path | None) -> tuple[FaultCodeTable, EscalationRules]:
    if path is None:
        return DEFAULT_TABLE, EscalationRules()
    loaded = load_fault_table(Path(path))
    return DEFAULT_TABLE.overridden_by(loaded.rows), loaded.escalation or EscalationRules()


def plan_entries(data: Any, source: str) -> list[dict[str, Any]]:
    """A fault plan's entries as stored, after checking them all (InputError otherwise)."""
    if data is None:
        return []
    parse_plan(data, source=source)
    entries = data.get("faults", []) if isinstance(data, Mapping) else data
    return [dict(e) for e in entries or []]


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


def submit(store: Store, submission: Submission, now: float) -> int:
    """Check a job fully and queue it as Pending; InputError lists every problem."""
    job = parse_job(submission.raw, source=submission.source)
    cluster = parse_cluster(submission.cluster, source="cluster settings")
    if submission.fault_table is not None:
        table_from(submission.fault_table)
    plan_entries(list(submission.plan), source=f"{submission.source}: fault plan")
    _check_fits(job, cluster, submission.source)
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


def abandon_unfinished(store: Store, directory: Path) -> None:
    """A new foreground run ends what an earlier, dead run left running (queued jobs stay)."""
    for job in store.jobs():
        if job.status.active:
            store.update_job(
                job.id,
                status=JobStatus.STOPPED,
                reason="abandoned: its controller died and `relaunch run --resume` was not used",
                ended_at=time.time(),
            )
    LocalCluster(directory).shutdown()


def _stored(store: Store, job_id: int) -> tuple[JobSpec, ClusterConfig, tuple[ChaosEntry, ...]]:
    row = store.job(job_id)
    job = parse_job(row.spec["raw"], source=row.spec["source"])
    if job.working_dir is None:
        job = dataclasses.replace(job, working_dir=row.spec.get("cwd"))
    cluster = parse_cluster(row.spec.get("cluster"), source="stored cluster settings")
    plan = parse_plan(row.plan, source="stored fault plan") if row.plan else ()
    return job, cluster, plan


def make_engine(
    stored: Mapping[str, Any] | None,
    directory: Path,
    cluster: ClusterConfig,
    remove_node: Callable[[str], None] | None = None,
) -> Engine:
    """The engine a job was submitted to: the embedded cluster, or Ray at the stored address."""
    if not stored or stored.get("kind") != "ray":
        return LocalCluster(directory)
    from relaunch.cluster.ray import RayCluster  # only with the `ray` extra

    return RayCluster.open(
        directory,
        str(stored["address"]),
        [n.name for n in cluster.nodes],
        select=stored.get("select"),
        remove_node=remove_node,
    )


def run_job(
    store: Store,
    directory: Path,
    job_id: int,
    *,
    resume: bool,
    remove_node: Callable[[str], None] | None = None,
    options: RunOptions | None = None,
    on_event: Callable[[str], None] = print,
    on_output: Callable[[int, int, str], None] | None = None,
    on_tick: Callable[[], None] | None = None,
    on_start: Callable[[Controller], None] | None = None,
) -> JobStatus:
    """Run (or resume) a stored job to its end with the lock held by the caller."""
    row = store.job(job_id)
    job, cluster, plan = _stored(store, job_id)
    store.ensure_nodes([(n.name, n.chips) for n in cluster.nodes])
    if options is None:
        table, rules = table_from(row.spec.get("fault_table"))
        options = RunOptions(startup_s=row.spec.get("startup_s"), table=table, rules=rules)
    options = dataclasses.replace(options, resume=resume)
    if not resume and not store.pods(job_id):
        create_pods(store, directory, job_id, job)
    controller = Controller(
        store,
        make_engine(row.spec.get("engine"), directory, cluster, remove_node),
        directory,
        cluster,
        job_id,
        job,
        plan,
        options,
        on_event=on_event,
        on_output=on_output,
        on_tick=on_tick,
    )
    if on_start is not None:
        on_start(controller)
    try:
        status, _ = controller.run()
    except KeyboardInterrupt:
        controller.stop("stopped by the user (Ctrl-C)")
        status = JobStatus.STOPPED
    return status


def run_queue(directory: Path, log: Callable[[str], None]) -> int:
    """The runner's loop: resume what a dead runner left, then run pending jobs in order.

    Returns how many jobs it ran. The caller holds the lock."""
    store = Store(directory / "relaunch.db")
    ran = 0
    while True:
        jobs = store.jobs()
        running = [j for j in jobs if j.status.active]
        pending = [j for j in jobs if j.status is JobStatus.PENDING]
        if running:
            job_id, resume = running[0].id, True
        elif pending:
            job_id, resume = pending[0].id, False
            if not store.claim_job(job_id, time.time()):
                continue  # stopped meanwhile
        else:
            return ran
        ran += 1
        name = store.job(job_id).name
        log(f"{'resuming' if resume else 'starting'} job {name} (id {job_id})")

        def event(text: str, job_id: int = job_id) -> None:
            log(f"job {job_id}: {text}")

        try:
            status = run_job(store, directory, job_id, resume=resume, on_event=event)
        except (InputError, RuntimeError) as error:
            could_not_start(store, job_id, error)
            log(f"job {job_id} could not start: {error}")
            continue
        log(f"job {name} (id {job_id}) ended: {status.value}")


def could_not_start(store: Store, job_id: int, error: Exception) -> None:
    """A job whose stored spec, cluster or placement no longer works ends Failed, saying why."""
    store.update_job(
        job_id, status=JobStatus.FAILED, reason=f"could not start: {error}", ended_at=time.time()
    )


def ensure_runner(directory: Path) -> int | None:
    """Start a detached runner if jobs wait and nobody holds the lock; its pid, or None."""
    store = Store(directory / "relaunch.db")
    try:
        waiting = any(not j.status.ended for j in store.jobs())
    finally:
        store.close()
    if not waiting:
        return None
    pid_file = directory / "runner.pid"
    if pid_file.exists():
        try:
            known = psutil.Process(int(pid_file.read_text()))
            if known.is_running() and known.status() != psutil.STATUS_ZOMBIE:
                return None  # started a moment ago and not holding the lock yet, or running
        except (ValueError, psutil.Error):
            pass
    try:
        lock(directory).close()  # free now; the runner takes it (and a racing one exits quietly)
    except RuntimeError:
        return None
    log = open(directory / "runner.log", "ab")  # noqa: SIM115
    env = dict(os.environ)
    process = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "runner", "--state-dir", str(directory)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    log.close()
    pid_file.write_text(str(process.pid))
    return process.pid
