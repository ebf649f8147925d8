"""MindSpore's launch contract, as msrun keeps it: every worker gets its role and rank in
MindSpore's variables, and one more process of the same command, the scheduler
(`MS_ROLE=MS_SCHED`), runs where rank 0 does and listens at the job's master address and port;
the workers meet through it when they call `mindspore.communication.init()`.

Pod 0's launcher starts the scheduler with rank 0 and ends it with rank 0 (every attempt forms
its cluster anew), in the pod's `scheduler` cgroup, its output to the pod's scheduler.log.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
from collections.abc import Mapping

from relaunch.containers import Cgroup
from relaunch.launcher.processes import (
    SPAWN_ERRORS,
    group_alive,
    signal_group,
    spawn,
    terminate,
)
from relaunch.protocol.environment import MS_TOPO_TIMEOUT_S, Env, mindspore_environment
from relaunch.protocol.layout import PodDir
from relaunch.protocol.plans import FRAMEWORK_MINDSPORE, LaunchPlan

__all__ = ["Scheduler", "worker_environment"]


def _scheduler_at(env: Mapping[str, str]) -> tuple[str, int]:
    """Where the scheduler listens: the job's master address (as msrun, an IP address) and
    port."""
    host = env.get(Env.MASTER_ADDR, "127.0.0.1")
    with contextlib.suppress(OSError):
        host = socket.gethostbyname(host)
    return host, int(env.get(Env.MASTER_PORT, "8118"))


def _timeout_s(env: Mapping[str, str]) -> int:
    """msrun's --cluster_time_out, where the job set it (as MS_TOPO_TIMEOUT), else its default."""
    with contextlib.suppress(ValueError):
        return int(env.get(Env.MS_TOPO_TIMEOUT, MS_TOPO_TIMEOUT_S))
    return MS_TOPO_TIMEOUT_S


def worker_environment(
    plan: LaunchPlan, env: Mapping[str, str], rank: int, local_rank: int
) -> dict[str, str]:
    """A rank's MindSpore variables where its job is a MindSpore job (else none)."""
    if plan.framework != FRAMEWORK_MINDSPORE:
        return {}
    world = int(env.get(Env.WORLD_SIZE, "1"))
    return mindspore_environment(rank, local_rank, world, _scheduler_at(env), _timeout_s(env))


class Scheduler:
    """The MindSpore scheduler of pod 0's current attempt (none for another pod or framework)."""

    def __init__(self, plan: LaunchPlan, pod_dir: PodDir, container: Cgroup | None) -> None:
        self.plan, self.dir = plan, pod_dir
        self.wanted = plan.framework == FRAMEWORK_MINDSPORE and plan.first_rank == 0
        self.cgroup = container.child("scheduler") if container is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = pod_dir.logs / "scheduler.log"
        self.events: selectors.BaseSelector | None = None
        self.pidfd: int | None = None

    def watch(self, events: selectors.BaseSelector) -> None:
        """The launcher's loop wakes when the scheduler exits (its pidfd), as for a rank's exit;
        where there are no pidfds, its process checks find it."""
        self._unwatch()
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.pidfd = os.pidfd_open(self.proc.pid)
            events.register(self.pidfd, selectors.EVENT_READ, "scheduler")
            self.events = events

    def _unwatch(self) -> None:
        if self.pidfd is None:
            return
        if self.events is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.events.unregister(self.pidfd)
        with contextlib.suppress(OSError):
            os.close(self.pidfd)
        self.pidfd = None

    def failed(self) -> str | None:
        """Why the workers cannot go on, said once: the scheduler ended on its own, not with
        the job (which ends it with code 0); None while it runs or after it ended well."""
        code = self.proc.poll() if self.proc is not None else None
        if self.proc is None or code is None:
            return None
        pid, self.proc = self.proc.pid, None
        self._unwatch()
        if code == 0:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return (
            f"MindSpore's scheduler (pid {pid}) {how}: the workers cannot keep their cluster "
            f"without it (its output: {self.log})"
        )

    def start(self, attempt: int, pod_env: Mapping[str, str]) -> None:
        """The attempt's scheduler, started (an earlier one ended first)."""
        if not self.wanted:
            return
        self.stop(0.0)
        world = int(pod_env.get(Env.WORLD_SIZE, "1"))
        env = {
            **pod_env,
            **mindspore_environment(None, 0, world, _scheduler_at(pod_env), _timeout_s(pod_env)),
        }
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.make()
        cgroup = self.cgroup if self.cgroup is not None and self.cgroup.exists() else None
        with open(self.log, "ab") as log:
            log.write(f"--- relaunch: MindSpore's scheduler, attempt {attempt} ---\n".encode())
            log.flush()
            try:
                cwd = self.plan.working_dir or str(self.dir.path)
                self.proc = spawn(self.plan.command, env, cwd, cgroup, log)
            except SPAWN_ERRORS as error:
                log.write(f"relaunch: the scheduler could not start: {error}\n".encode())
                self.proc = None

    def stop(self, grace: float) -> None:
        """The scheduler ended: SIGTERM, SIGKILL after `grace`, and whatever it started."""
        proc, self.proc = self.proc, None
        self._unwatch()
        if proc is not None and proc.poll() is None:
            if grace > 0:
                terminate(proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
            signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if proc is not None and group_alive(proc):
            signal_group(proc.pid, signal.SIGKILL)
        if self.cgroup is not None and self.cgroup.exists():
            self.cgroup.kill()
            self.cgroup.wait_empty(5.0)
