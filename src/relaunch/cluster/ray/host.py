"""The node host: a detached actor pinned to its node that starts relaunch's processes there."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import ray

from relaunch.cluster.local import free_port, kill_tree
from relaunch.cluster.ray.discovery import node_environment
from relaunch.containers import Cgroup, ClusterCgroups

__all__ = ["NodeHost"]


class NodeHost:
    """Runs on one node (a detached actor); starts and kills relaunch's processes there."""

    def __init__(self, state_dir: str, node: str = "") -> None:
        self.state_dir = state_dir
        self.node = node
        self.children: dict[str, int] = {}
        self.raylet = os.getppid()
        self.dead = False
        probed = ClusterCgroups.probe(Path(state_dir))
        self.cgroups = probed if isinstance(probed, ClusterCgroups) and node else None
        """This node's pods as cgroups, as on the embedded cluster (None: process groups)."""
        self.no_cgroups_because = probed if isinstance(probed, str) else "no node name"

    def ping(self) -> int:
        return os.getpid()

    def containers(self) -> str:
        """What a pod is on this node, in words."""
        if self.cgroups is not None:
            return f"cgroups under {self.cgroups.node(self.node).path}"
        return f"process groups ({self.no_cgroups_because})"

    def _cgroup(self, key: str) -> tuple[Cgroup | None, list[str]]:
        """The cgroup the process `key` starts in, and the arguments that tell it its own."""
        if self.cgroups is None:
            return None, []
        if key == "agent":
            return self.cgroups.agent_placement(self.node)
        job, pod, generation = (int(part) for part in key.split("/"))
        return self.cgroups.launcher_placement(self.node, job, pod, generation)

    def spawn(self, key: str, module: str, args: list[str], log: str, files: dict[str, str]) -> int:
        if self.dead:
            raise RuntimeError("this node is going down")
        cgroup, extra = self._cgroup(key)
        for path, text in files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, "--state-dir", self.state_dir, *args, *extra],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives this actor and the controller, as on local
                env=node_environment(),
                preexec_fn=cgroup.join if cgroup is not None else None,
            )
        self.children[key] = proc.pid
        threading.Thread(target=proc.wait, daemon=True).start()  # reap it
        return proc.pid

    def rekey(self, old: str, new: str) -> None:
        if old in self.children:
            self.children[new] = self.children.pop(old)

    def kill_all(self) -> int | None:
        """Kill what relaunch started here; with cgroups, how many processes the pods left
        behind (killed with the node's cgroup, which is then removed)."""
        own = set(self.children.values())
        for pid in own:
            kill_tree(pid)
        self.children.clear()
        if self.cgroups is None:
            return None
        node = self.cgroups.node(self.node)
        # what relaunch started here is not what the pods left, even one still in its exit
        left = len(node.census(besides=own, settle_s=1.0))
        node.end()
        # the cluster's own cgroup goes with its last node (the others' hosts end theirs at the
        # same time: whichever finds it empty removes it)
        self.cgroups.root.remove()
        return left

    def free_port(self) -> int:
        return free_port("0.0.0.0")

    def crash(self) -> None:
        """The node dies at once: every process relaunch started here, its raylet, this actor.
        Nothing is started here any more, and nothing waits: a node does not die in steps."""
        self.dead = True
        if self.cgroups is not None:
            self.cgroups.node(self.node).kill()
        family: list[psutil.Process] = []
        for pid in self.children.values():
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                family += [root, *root.children(recursive=True)]
        for process in family:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(self.raylet, signal.SIGKILL)
        os._exit(1)


RemoteNodeHost: Any = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(NodeHost)  # type: ignore[call-overload]
