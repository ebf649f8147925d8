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

__all__ = ["NodeHost"]


class NodeHost:
    """Runs on one node (a detached actor); starts and kills relaunch's processes there."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.children: dict[str, int] = {}
        self.raylet = os.getppid()
        self.dead = False

    def ping(self) -> int:
        return os.getpid()

    def spawn(self, key: str, module: str, args: list[str], log: str, files: dict[str, str]) -> int:
        if self.dead:
            raise RuntimeError("this node is going down")
        for path, text in files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, "--state-dir", self.state_dir, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives this actor and the controller, as on local
                env=node_environment(),
            )
        self.children[key] = proc.pid
        threading.Thread(target=proc.wait, daemon=True).start()  # reap it
        return proc.pid

    def rekey(self, old: str, new: str) -> None:
        if old in self.children:
            self.children[new] = self.children.pop(old)

    def kill_all(self) -> None:
        for pid in self.children.values():
            kill_tree(pid)
        self.children.clear()

    def free_port(self) -> int:
        return free_port("0.0.0.0")

    def crash(self) -> None:
        """The node dies at once: every process relaunch started here, its raylet, this actor.
        Nothing is started here any more, and nothing waits: a node does not die in steps."""
        self.dead = True
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
