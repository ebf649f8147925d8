"""Starting a pod's rank: its environment (torchrun's, ModelArts' and relaunch's own), its cgroup
(where the pod is a container), its log, and its process (a new one, or a warm spare that takes
the rank). A command that cannot be started is the rank's exit with the code a shell would give
(127: no such program; 126: not allowed), so that the recovery ladder handles it like any failed
start.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from relaunch.containers import Cgroup
from relaunch.diagnosis.errors import (
    ERROR_FILE_AT_MOST,
    error_from_file,
    error_from_large_file,
    error_from_output,
)
from relaunch.faults.kinds import ErrorReport
from relaunch.launcher.mindspore import worker_environment
from relaunch.launcher.processes import (
    SPAWN_ERRORS,
    NotStarted,
    RankLog,
    RankProcess,
    Worker,
    spawn,
)
from relaunch.launcher.spares import Spare, SparePool
from relaunch.launcher.template import RankTemplate
from relaunch.protocol.environment import Env
from relaunch.protocol.layout import PodDir
from relaunch.protocol.plans import LaunchPlan

__all__ = ["INJECT_DIR", "Pod", "pod_environment", "rank_error", "rank_source", "start_rank"]

INJECT_DIR = Path(__file__).parent.parent / "_inject"
"""What every rank imports first (sitecustomize): a fault plan's exit fires inside its Python."""


@dataclass
class Pod:
    """What a rank is started in: the plan, the pod's directory and container, its spares and
    its rank template."""

    plan: LaunchPlan
    dir: PodDir
    container: Cgroup | None
    spares: SparePool
    template: RankTemplate

    @classmethod
    def of(
        cls, plan: LaunchPlan, pod_dir: PodDir, container: Cgroup | None, wake: Callable[[], None]
    ) -> Pod:
        """The pod, its spares and template waiting in its `spares` cgroup; `wake` is called
        when a spare is ready or a rank forked from the template ends."""
        waiting = container.child("spares") if container is not None else None
        spares = SparePool(plan.warm_spares, plan.command, on_ready=wake, container=waiting)
        template = RankTemplate(plan.command, on_exit=wake, container=waiting)
        return cls(plan, pod_dir, container, spares, template)

    def rank_cgroup(self, rank: int) -> Cgroup | None:
        """Rank `rank`'s cgroup in the pod's container (None: no cgroups)."""
        return self.container.child(f"rank-{rank}") if self.container is not None else None


def pod_environment(
    plan: LaunchPlan, pod_dir: PodDir, env: Mapping[str, str], relay: Mapping[str, str]
) -> dict[str, str]:
    """What every process of the pod sees, before its rank is set (`relay`: how the SDK reaches
    the launcher)."""
    child_env = {**os.environ, **plan.env, **env}
    if (plan.host_processes or plan.procs_per_pod) > 1:
        # torchrun's rule: several processes on a host share its cores, one OpenMP thread
        # each unless the job (or the user's environment) says otherwise; spares too: torch
        # reads it when imported. On the embedded cluster every node is this machine.
        child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(
        {
            **relay,
            Env.INJECT_DIR: str(pod_dir.inject),
            Env.WORKDIR: str(pod_dir.path),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(INJECT_DIR), child_env.get("PYTHONPATH", "")) if p
            ),
            "PYTHONUNBUFFERED": "1",
            # `python` in the command means the Python relaunch runs on, venv included.
            "PATH": os.pathsep.join((str(Path(sys.executable).parent), child_env.get("PATH", ""))),
        }
    )
    return child_env


def start_rank(
    pod: Pod, pod_env: dict[str, str], attempt: int, rank: int, local_rank: int
) -> Worker:
    """Rank `rank` of the pod started for `attempt`, in its cgroup, its output appended to its
    log (which holds every attempt of the rank; the launcher reads from where this one's
    begins): it comes from `rank_source`, else it starts as a new process."""
    child_env = _rank_environment(pod, pod_env, rank, local_rank)
    cgroup = _fresh_cgroup(pod.rank_cgroup(rank))
    spare, template = rank_source(pod.spares, pod.template, child_env.get("CUDA_VISIBLE_DEVICES"))
    cwd = pod.plan.working_dir or str(pod.dir.path)
    path = pod.dir.rank_log(rank)
    how = ""
    if spare is not None:
        how = f", warm spare pid {spare.proc.pid}"
    elif template is not None and template.proc is not None:
        how = f", forked from the rank template pid {template.proc.pid}"
    start_error = None
    proc: RankProcess | None = None
    with open(path, "ab") as log:
        log.write(
            f"--- relaunch: attempt {attempt}, "
            f"{Env.PROC_START_CNT}={pod_env.get(Env.PROC_START_CNT)}{how} ---\n".encode()
        )
        log.flush()
        output = RankLog(path)
        if spare is not None and pod.spares.argv is not None:
            # moved before it runs the rank's code: all it forks is born there
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.add(spare.proc.pid)
            proc = spare.become(child_env, pod.spares.argv, cwd, str(path))
        elif template is not None:
            proc = template.fork(child_env, cwd, str(path), cgroup)
            if proc is None:
                log.write(
                    b"relaunch: the rank template is gone: this rank starts as a new process\n"
                )
                log.flush()
        if proc is None:
            proc, start_error = _new_process(pod, child_env, cwd, cgroup, log)
    if start_error is not None:
        output.close()  # nothing will write to it
    kept = output if start_error is None else None
    return Worker(rank, local_rank, attempt, proc, kept, start_error=start_error)


def rank_source(
    spares: SparePool, template: RankTemplate, visible: str | None
) -> tuple[Spare | None, RankTemplate | None]:
    """What a rank that sees the GPUs `visible` comes from, the quickest first: a warm spare
    that is ready; the rank template, ready; a spare still importing, waited for; the template,
    waited for; (None, None): a new process. A ready template forks in milliseconds, where a
    spare refilled moments before still has seconds of imports left (a bench run's fault 1.3 s
    after its ranks started waited 12.5 s for one, the template ready beside it)."""
    if spares.argv is not None:
        spare = spares.take(visible, wait=not (template.usable() and template.ready.is_set()))
        if spare is not None:
            return spare, None
    return None, template if template.usable() else None


def _new_process(
    pod: Pod, child_env: dict[str, str], cwd: str, cgroup: Cgroup | None, log: BinaryIO
) -> tuple[RankProcess, str | None]:
    """The rank's command started as a new process (its output to `log`); or, where it cannot
    be, a NotStarted and why."""
    try:
        proc = spawn(pod.plan.command, child_env, cwd, cgroup, log)
    except SPAWN_ERRORS as error:
        start_error = f"could not start {pod.plan.command[0]!r} in {cwd}: {error}"
        log.write(f"relaunch: {start_error}\n".encode())
        return NotStarted(126 if isinstance(error, PermissionError) else 127), start_error
    return proc, None


def _rank_environment(
    pod: Pod, pod_env: dict[str, str], rank: int, local_rank: int
) -> dict[str, str]:
    """The pod's environment with the rank's own variables, as torchrun gives them (and msrun,
    for a MindSpore job)."""
    error_file = pod.dir.error_file(rank)
    error_file.parent.mkdir(exist_ok=True)
    error_file.unlink(missing_ok=True)  # what an earlier process of this rank wrote
    child_env = {
        **pod_env,
        Env.RANK: str(rank),
        Env.ROLE_RANK: str(rank),  # one role: its rank is the global rank, as torchrun's
        Env.LOCAL_RANK: str(local_rank),
        Env.ERROR_FILE: str(error_file),
    }
    child_env.update(worker_environment(pod.plan, pod_env, rank, local_rank))  # msrun's
    child_env.setdefault(Env.NCCL_ASYNC_ERROR_HANDLING, "1")  # torchrun's defaults
    # NCCL takes ranks with one host identity and one GPU for a mistake ("Duplicate GPU
    # detected"); ranks of different nodes sharing the machine's GPU are different hosts
    child_env.setdefault(Env.NCCL_HOSTID, f"relaunch-{pod.plan.node}")
    child_env.setdefault(Env.SIGNALS_TO_HANDLE, "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    return child_env


def _fresh_cgroup(cgroup: Cgroup | None) -> Cgroup | None:
    """The rank's cgroup, made, and emptied of what an earlier process of the rank left there
    (None: it cannot be made, and the rank runs as a process group only)."""
    if cgroup is None:
        return None
    try:
        cgroup.make()
    except OSError:
        return None
    cgroup.kill()
    cgroup.wait_empty(5.0)
    return cgroup


def rank_error(worker: Worker, pod_dir: PodDir) -> ErrorReport | None:
    """What the failed rank said: its torchelastic error file (timed by when it was written),
    else the traceback or last lines of its output."""
    path = pod_dir.error_file(worker.rank)
    try:
        status = path.stat()
        with open(path, "rb") as file:
            if status.st_size > ERROR_FILE_AT_MOST:  # not parsed whole: its start says enough
                head = file.read(64 << 10).decode("utf-8", "replace")
                return error_from_large_file(head, status.st_size, status.st_mtime)
            data = json.loads(file.read().decode("utf-8", "replace"))
        written = status.st_mtime
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict):
        found = error_from_file(data, written)
        if found is not None:
            return found
    return error_from_output(list(worker.tail))
