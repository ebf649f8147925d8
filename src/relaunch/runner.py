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
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from relaunch.chaos import ChaosEntry, check_plan, parse_plan
from relaunch.cluster import Engine
from relaunch.cluster.config import ClusterConfig, parse_cluster
from relaunch.cluster.local import LocalCluster
from relaunch.controller import Controller, RunOptions
from relaunch.errors import FaultPlanError, InputError, Problem, SpecError
from relaunch.faults import DEFAULT_TABLE, EscalationRules, FaultCodeTable
from relaunch.files import load_fault_table
from relaunch.policy.placement import NodeCapacity, initial_placement, slots
from relaunch.protocol import StateDir
from relaunch.spec import JobSpec, parse_job
from relaunch.store import JobRow, JobStatus, PodRow, Store

__all__ = [
    "Interrupted",
    "RunnerState",
    "Submission",
    "abandon_unfinished",
    "check_plan_fits",
    "could_not_start",
    "create_pods",
    "ensure_runner",
    "lock",
    "lock_holder",
    "make_engine",
    "plan_entries",
    "run_job",
    "run_queue",
    "stored_job",
    "submit",
    "table_from",
]


def lock(directory: Path, role: str = "run") -> IO[str]:
    """The state directory's run lock; RuntimeError if another run or runner holds it. The
    holder writes its pid and role ("run": a foreground `relaunch run`; "runner": the queue's
    runner) into the lock file, so that others can say who has it."""
    handle = open(directory / "run.lock", "a+")  # noqa: SIM115
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        holder = lock_holder(directory)
        who = f" (pid {holder[0]}, {holder[1]})" if holder else ""
        raise RuntimeError(
            f"another `relaunch run` or runner{who} is using {directory}; wait for it or pass "
            "another --state-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "role": role}))
    handle.flush()
    return handle


def lock_holder(directory: Path) -> tuple[int, str] | None:
    """(pid, role) of whoever holds the state directory's lock now, if anyone does."""
    path = directory / "run.lock"
    try:
        with open(path) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                data = json.loads(path.read_text() or "{}")
                return int(data["pid"]), str(data["role"])
            fcntl.flock(handle, fcntl.LOCK_UN)
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def abandon_unfinished(store: Store, directory: Path) -> list[JobRow]:
    """A new foreground run ends what an earlier, dead run left running (queued jobs stay);
    returns the jobs it abandoned, so that the caller can say so."""
    abandoned = []
    for job in store.jobs():
        if job.status.active:
            store.update_job(
                job.id,
                status=JobStatus.STOPPED,
                reason="abandoned: its controller died and `relaunch run --resume` was not used",
                ended_at=time.time(),
            )
            abandoned.append(job)
    LocalCluster(directory).shutdown()
    return abandoned


def stored_job(row: JobRow) -> tuple[JobSpec, ClusterConfig]:
    """The job and cluster a stored job runs with (its working directory made absolute)."""
    job = parse_job(row.spec["raw"], source=row.spec["source"])
    cwd = row.spec.get("cwd") or os.getcwd()
    job = dataclasses.replace(job, working_dir=str(Path(cwd, job.working_dir or ".")))
    cluster = parse_cluster(row.spec.get("cluster"), source="stored cluster settings")
    return job, cluster


def _stored(store: Store, job_id: int) -> tuple[JobSpec, ClusterConfig, tuple[ChaosEntry, ...]]:
    row = store.job(job_id)
    job, cluster = stored_job(row)
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
    except Interrupted as interrupt:
        controller.stop(f"stopped by the user ({interrupt.how})")
        status = JobStatus.STOPPED
    except KeyboardInterrupt:
        controller.stop("stopped by the user (Ctrl-C)")
        status = JobStatus.STOPPED
    return status


class Interrupted(KeyboardInterrupt):
    """`relaunch run` was asked to stop by a signal (SIGTERM from systemd, docker, `timeout`):
    handled as Ctrl-C is, the job stopped in order."""

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.how = how


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


def create_pods(store: Store, directory: Path, job_id: int, spec: JobSpec) -> list[PodRow]:
    """Place a new job's pods in order on the first Ready nodes with chips for them."""
    nodes = [NodeCapacity(n.name, n.chips, n.schedulable) for n in store.nodes()]
    places = initial_placement(nodes, spec.replicas, spec.chips_per_pod)
    if places is None:
        room = len(slots([n for n in nodes if n.schedulable], spec.chips_per_pod, False))
        raise RuntimeError(
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


def could_not_start(store: Store, job_id: int, error: Exception) -> None:
    """A job whose stored spec, cluster or placement no longer works ends Failed, saying why."""
    store.update_job(
        job_id, status=JobStatus.FAILED, reason=f"could not start: {error}", ended_at=time.time()
    )


@dataclass(frozen=True)
class RunnerState:
    """What `ensure_runner` found or did."""

    started: int | None = None
    """The pid of a runner started now."""
    running: int | None = None
    """The pid of a runner already running (or starting)."""
    foreground: int | None = None
    """The pid of a foreground `relaunch run` holding the state directory: queued jobs start
    when it ends (it starts a runner for them then)."""
    idle: bool = False
    """No job waits."""


def ensure_runner(directory: Path) -> RunnerState:
    """Start a detached runner if jobs wait and nobody holds the lock."""
    store = Store(directory / "relaunch.db")
    try:
        waiting = any(not j.status.ended for j in store.jobs())
    finally:
        store.close()
    if not waiting:
        return RunnerState(idle=True)
    pid_file = directory / "runner.pid"
    known = _runner_of(directory, pid_file)
    if known is not None:
        return RunnerState(running=known)  # started a moment ago and not holding the lock yet
    try:
        lock(directory, role="probe").close()  # free now; the runner takes it
    except RuntimeError:
        holder = lock_holder(directory)
        if holder is not None and holder[1] == "run":
            return RunnerState(foreground=holder[0])
        return RunnerState(running=holder[0] if holder else None)
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
    return RunnerState(started=process.pid)


def _runner_of(directory: Path, pid_file: Path) -> int | None:
    """The pid in runner.pid if it is a live runner of this state directory (a pid the kernel
    has since given to another process is not)."""
    try:
        process = psutil.Process(int(pid_file.read_text()))
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        command = process.cmdline()
    except (OSError, ValueError, psutil.Error):
        return None
    if "runner" in command and str(directory) in command:
        return process.pid
    return None
