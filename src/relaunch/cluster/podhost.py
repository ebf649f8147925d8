"""A node's pods started by its own agent: what an agent on a machine of its own does (a Slurm
step, `relaunch agent` started by hand), where no engine process on that machine can fork them.

The controller sends the agent each pod's plan (`StartPod`); the agent writes it into the pod's
directory and starts the pod's launcher there, in a session of its own, in the pod's cgroup from
its first instruction where the node has cgroup v2 (as the embedded cluster does), with the
node's environment less what the batch system set for the agent's own step (`SLURM_*`: a rank
that saw them would take itself for a Slurm task, as Lightning does). A crash (`Crash`, the fault
plan's node-down) kills every process of the node's pods at once; the end kills what is left and
counts what the pods left behind in their cgroups.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from relaunch.cluster.local import free_port, kill_tree
from relaunch.containers import Cgroup, ClusterCgroups
from relaunch.protocol.layout import PodDir
from relaunch.protocol.plans import LaunchPlan

if TYPE_CHECKING:
    from relaunch.cluster.kubernetes.objects import Container

__all__ = ["PodHost", "pod_host_environment"]

STRIPPED_PREFIXES: Final = ("SLURM_", "SLURMD_", "SRUN_")
"""What the agent's own step was given and a pod must not see."""


def pod_host_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a hosted pod's launcher starts with: the agent's, less its step's."""
    env = dict(os.environ if environ is None else environ)
    return {k: v for k, v in env.items() if not k.startswith(STRIPPED_PREFIXES)}


class PodHost:
    """Starts and kills the launchers of one node's pods, from that node's agent."""

    def __init__(self, state_dir: Path, node: str) -> None:
        self.state_dir = state_dir
        self.node = node
        probed = ClusterCgroups.probe(state_dir)
        self.cgroups = probed if isinstance(probed, ClusterCgroups) else None
        self.containers = (
            f"cgroups under {self.cgroups.node(node).path}"
            if self.cgroups is not None
            else f"process groups ({probed})"
        )
        self.launchers: dict[tuple[int, int, int], int] = {}
        """(job, pod, generation) -> the pid of its launcher (-1: a standby launcher)."""
        self.plain_pods: dict[str, tuple[int, Cgroup | None]] = {}
        """A Kubernetes Pod's uid -> its container's process and cgroup (`run`)."""
        self.lock = threading.Lock()

    def start(self, plan: LaunchPlan, on_exit: Callable[[int], None] | None = None) -> int:
        """The launcher of `plan`, started now; its pid. `on_exit` is told its exit status."""
        pod = PodDir(Path(plan.workdir))
        pod.path.mkdir(parents=True, exist_ok=True)
        pod.plan.write_text(plan.to_json())
        cgroup: Cgroup | None = None
        extra: list[str] = []
        if self.cgroups is not None:
            cgroup, extra = self.cgroups.launcher_placement(
                self.node, plan.job, plan.pod, plan.generation
            )
        with open(pod.launcher_log, "a") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "relaunch.launcher", "--state-dir", str(self.state_dir),
                 "--plan", str(pod.plan), *extra],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its pod outlives a restarted agent, as on local
                env=pod_host_environment(),
                preexec_fn=cgroup.join if cgroup is not None else None,
            )  # fmt: skip
        with self.lock:
            self.launchers[(plan.job, plan.pod, plan.generation)] = proc.pid

        def reap() -> None:  # when it exits
            code = proc.wait()
            if on_exit is not None:
                on_exit(code)

        threading.Thread(target=reap, daemon=True).start()
        return proc.pid

    def run(self, uid: str, container: Container, log: Path, on_exit: Callable[[int], None]) -> int:
        """A Pod that is not relaunch's: its container's command as a process of this node, in
        a cgroup of its own (`k8s-<uid>`), with the node's environment and the container's;
        its pid. `on_exit` is told its exit status."""
        cgroup = self.cgroups.node(self.node).child(f"k8s-{uid}").make() if self.cgroups else None
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                container.argv, cwd=container.workdir, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**pod_host_environment(), **container.env},
                preexec_fn=cgroup.join if cgroup is not None else None,
            )  # fmt: skip
        with self.lock:
            self.plain_pods[uid] = (proc.pid, cgroup)

        def reap() -> None:
            code = proc.wait()
            with self.lock:
                gone = self.plain_pods.pop(uid, None) is None
            if cgroup is not None:  # what the command left behind goes with it
                cgroup.end()
            if not gone:
                on_exit(code)

        threading.Thread(target=reap, daemon=True).start()
        return proc.pid

    def stop_container(self, uid: str) -> None:
        """A Pod's container killed (its Pod was deleted), and everything it started."""
        with self.lock:
            pid, cgroup = self.plain_pods.pop(uid, (0, None))
        if cgroup is not None:
            cgroup.end()
        if pid > 0:
            kill_tree(pid)

    def stop(self, job: int, pod: int, generation: int) -> None:
        """One pod's launcher and all it started, killed (its Pod was deleted)."""
        with self.lock:
            pid = self.launchers.pop((job, pod, generation), None)
        if pid is not None and pid > 0:
            kill_tree(pid)

    @staticmethod
    def free_port() -> int:
        return free_port("0.0.0.0")

    def crash(self) -> None:
        """The node dies: every process of its pods killed at once, nothing waited for."""
        if self.cgroups is not None:
            self.cgroups.node(self.node).kill()
        with self.lock:
            pids = [*self.launchers.values(), *(pid for pid, _ in self.plain_pods.values())]
        for pid in pids:
            kill_tree(pid, wait=False)

    def end(self) -> int | None:
        """Kill what is left of the node's pods; with cgroups, how many processes they left
        behind (their launchers gone: the controller ended them first), and the cgroups gone."""
        with self.lock:
            pids = list(self.launchers.values())
            self.launchers.clear()
            plain = list(self.plain_pods)
        for pid in pids:
            kill_tree(pid)
        for uid in plain:
            self.stop_container(uid)
        if self.cgroups is None:
            return None
        left = 0
        for pod in self.cgroups.pods(self.node):
            with contextlib.suppress(OSError):
                left += len(pod.census(settle_s=1.0))
                pod.end()
        return left
