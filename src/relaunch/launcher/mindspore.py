"""MindSpore's launch contract, as msrun keeps it: every worker gets its role and rank in
MindSpore's variables, and one more process of the same command, the scheduler
(`MS_ROLE=MS_SCHED`), runs where rank 0 does and listens at the job's master address and port;
the workers meet through it when they call `mindspore.communication.init()`.

Pod 0's launcher starts the scheduler with rank 0 and ends it with rank 0 (every attempt forms
its cluster anew), in the pod's `scheduler` cgroup, its output to the pod's scheduler.log.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
from collections.abc import Mapping

from relaunch.containers import Cgroup
from relaunch.launcher.processes import group_alive, in_container, signal_group, terminate
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
        with open(self.dir.logs / "scheduler.log", "ab") as log:
            log.write(f"--- relaunch: MindSpore's scheduler, attempt {attempt} ---\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    list(self.plan.command),
                    cwd=self.plan.working_dir or str(self.dir.path),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=in_container(cgroup),
                )
            except (OSError, ValueError, subprocess.SubprocessError) as error:
                log.write(f"relaunch: the scheduler could not start: {error}\n".encode())
                self.proc = None

    def stop(self, grace: float) -> None:
        """The scheduler ended: SIGTERM, SIGKILL after `grace`, and whatever it started."""
        proc, self.proc = self.proc, None
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
