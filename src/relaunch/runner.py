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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from relaunch import engines
from relaunch.cluster import Engine
from relaunch.cluster.config import ClusterConfig
from relaunch.cluster.local import LocalCluster
from relaunch.controller import Controller, RunOptions
from relaunch.controller.core import print_event
from relaunch.errors import RelaunchError, StateDirBusy
from relaunch.events import Event
from relaunch.faults.plan import PlannedFault, parse_plan
from relaunch.protocol.layout import StateDir
from relaunch.service import create_pods, stored_job, table_from
from relaunch.spec import JobSpec
from relaunch.states import StopCause
from relaunch.store import JobRow, JobStatus, Store

__all__ = [
    "Interrupted",
    "RunnerState",
    "abandon_unfinished",
    "could_not_start",
    "ensure_runner",
    "lock",
    "lock_holder",
    "make_engine",
    "run_job",
    "run_queue",
]


def lock(directory: Path, role: str = "run") -> IO[str]:
    """The state directory's run lock; StateDirBusy if another run or runner holds it. The
    holder writes its pid and role ("run": a foreground `relaunch run`; "runner": the queue's
    runner) into the lock file, so that others can say who has it."""
    handle = open(directory / "run.lock", "a+")  # noqa: SIM115
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        holder = lock_holder(directory)
        who = f" (pid {holder[0]}, {holder[1]})" if holder else ""
        raise StateDirBusy(
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


def abandon_unfinished(store: Store, directory: Path) -> list[JobRow]:
    """A new foreground run ends what an earlier, dead run left running (queued jobs stay);
    returns the jobs it abandoned, so that the caller can say so."""
    abandoned = []
    for job in store.jobs():
        if job.status.active:
            said = "abandoned: its controller died and `relaunch run --resume` was not used"
            stopped, cause = JobStatus.STOPPED, StopCause.ABANDONED
            store.move_job(job.id, job.status, stopped, time.time(), reason=said, cause=cause)
            abandoned.append(job)
    LocalCluster(directory).shutdown()
    return abandoned


def _stored(store: Store, job_id: int) -> tuple[JobSpec, ClusterConfig, tuple[PlannedFault, ...]]:
    row = store.job(job_id)
    job, cluster = stored_job(row)
    plan = parse_plan(row.plan, source="stored fault plan") if row.plan else ()
    return job, cluster, plan


def make_engine(
    stored: Mapping[str, Any] | None, at: engines.Opening
) -> tuple[Engine, ClusterConfig]:
    """The engine a job was submitted to (its stored settings: the embedded cluster where none),
    opened again, and the job's cluster on it (a requeued Slurm job's new allocation)."""
    return engines.kind_of_stored(stored).open(stored or {}, at)


def run_job(
    store: Store,
    directory: Path,
    job_id: int,
    *,
    resume: bool,
    remove_node: Callable[[str], None] | None = None,
    options: RunOptions | None = None,
    on_event: Callable[[Event], None] = print_event,
    on_output: Callable[[int, int, str], None] | None = None,
    on_tick: Callable[[], None] | None = None,
    on_start: Callable[[Controller], None] | None = None,
    engine: Engine | None = None,
) -> JobStatus:
    """Run (or resume) a stored job to its end with the lock held by the caller, on the engine it
    was submitted to (`engine`: on this one instead; the bench's simulated cluster)."""
    row = store.job(job_id)
    job, cluster, plan = _stored(store, job_id)
    if engine is None:
        requeued = options is not None and options.resumed_from is StopCause.WANTS_NODES
        at = engines.Opening(directory, store, cluster, remove_node, requeued)
        engine, cluster = make_engine(row.spec.get("engine"), at)
    store.ensure_nodes([(n.name, n.chips) for n in cluster.nodes])
    if options is None:
        table, rules = table_from(row.spec.get("fault_table"))
        options = RunOptions(startup_s=row.spec.get("startup_s"), table=table, rules=rules)
    options = dataclasses.replace(options, resume=resume)
    if not resume and not store.pods(job_id):
        create_pods(store, directory, job_id, job)
    controller = Controller(
        store,
        engine,
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
        controller.stop(
            f"stopped by the user ({interrupt.how})", StopCause.of_signal(interrupt.how)
        )
        status = JobStatus.STOPPED
    except KeyboardInterrupt:
        controller.stop("stopped by the user (Ctrl-C)", StopCause.CTRL_C)
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
    store = Store(StateDir(directory).db)
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

        def event(said: Event, job_id: int = job_id) -> None:
            log(f"job {job_id}: {said.text}")

        try:
            status = run_job(store, directory, job_id, resume=resume, on_event=event)
        except RelaunchError as error:
            could_not_start(store, job_id, error)
            log(f"job {job_id} could not start: {error}")
            continue
        log(f"job {name} (id {job_id}) ended: {status.value}")


def could_not_start(store: Store, job_id: int, error: Exception) -> None:
    """A job whose stored spec, cluster or placement no longer works ends Failed, saying why."""
    job = store.job(job_id)
    if not job.status.ended:
        reason = f"could not start: {error}"
        store.move_job(job_id, job.status, JobStatus.FAILED, time.time(), reason=reason)


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
    store = Store(StateDir(directory).db)
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
    except StateDirBusy:
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
