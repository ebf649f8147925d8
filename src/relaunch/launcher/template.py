"""The pod's rank template (see relaunch._template): started with the launcher, it imports torch
once, and the pod's ranks are forked from it instead of each starting a new Python. Where the
job's command is `python script.py args` and the script imports torch (or a framework on it):
a script that does not gains nothing from a template."""

from __future__ import annotations

import ast
import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from relaunch._template import ENVIRONMENT_ROOM
from relaunch.containers import Cgroup
from relaunch.launcher.processes import in_container
from relaunch.launcher.spares import spare_argv
from relaunch.protocol.environment import Env

__all__ = ["Forked", "RankTemplate", "template_argv"]

READY_WAIT_S = 60.0
"""How long a rank's start waits for the template to finish its imports: as long as a new
process would spend on the same imports, at most; past it (a template stuck), ranks start cold."""
FORK_WAIT_S = 10.0
"""How long a fork may take before the template is given up on (it forks in milliseconds)."""


class Forked:
    """A rank forked by the template: the launcher's handle on it, as a Popen is on a process
    the launcher started (pid, poll, wait, kill). Its exit code comes from the template, which
    reaps it."""

    stdin = None
    stdout = None

    def __init__(self, pid: int, template: RankTemplate) -> None:
        self.pid = pid
        self.template = template
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.template.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            self.template.wait_for_exit(left)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class RankTemplate:
    """The launcher's side of the template: started once (`start`), it forks ranks (`fork`)
    once it is ready. Without one (the command is not `python script.py` on this Python, or
    RELAUNCH_RANK_TEMPLATE=0), or once it has died, ranks start as new processes."""

    SERVE = "serve"
    """RELAUNCH_RANK_TEMPLATE in the template's environment: sitecustomize serves as one."""

    def __init__(
        self,
        command: tuple[str, ...],
        on_exit: Callable[[], None] = lambda: None,
        container: Cgroup | None = None,
    ) -> None:
        self.command = list(command)
        self.argv: list[str] | None = None
        """The command line the template started with: the ranks' own."""
        self.container = container
        """Where the template waits (the pod's `spares` cgroup); each rank moves to its own."""
        self.on_exit = on_exit
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = threading.Event()
        self.changed = threading.Condition()
        self.forked: list[int] = []
        """Pids the template said it forked, not yet taken by `fork`."""
        self.exits: dict[int, int] = {}
        self.gone = False

    def start(self, cwd: Path, env: dict[str, str]) -> None:
        """Start the template with the pod's environment (no-op where there is none to start)."""
        if self.proc is not None or self.gone or env.get(Env.RANK_TEMPLATE) == "0":
            return
        self.argv = template_argv(self.command, cwd)
        if self.argv is None:
            return
        if self.container is not None:
            try:
                self.container.make()
            except OSError:
                return
        try:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=cwd,
                env={**env, Env.RANK_TEMPLATE: self.SERVE, ENVIRONMENT_ROOM: _room(env)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=in_container(self.container),
            )
        except (OSError, subprocess.SubprocessError):
            self.gone = True
            return
        threading.Thread(target=self._listen, daemon=True).start()

    def usable(self) -> bool:
        """A rank may come from the template (started, not gone)."""
        return self.argv is not None and self.proc is not None and not self.gone

    def fork(self, env: dict[str, str], cwd: str, log: str, cgroup: Cgroup | None) -> Forked | None:
        """The rank forked from the template, or None (no template, or it is not ready within
        READY_WAIT_S or has died: the rank starts as a new process)."""
        if not self.usable() or self.argv is None or self.proc is None:
            return None
        deadline = time.monotonic() + READY_WAIT_S
        with self.changed:
            while not self.ready.is_set() and not self.gone and time.monotonic() < deadline:
                self.changed.wait(0.5)
        if not self.ready.is_set() or self.gone:
            return None
        identity = {
            "env": env,
            "cwd": cwd,
            "log": log,
            "cgroup": str(cgroup.path) if cgroup is not None else None,
        }
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(msgspec.json.encode(identity) + b"\n")
            self.proc.stdin.flush()
        except OSError:
            self._give_up()
            return None
        deadline = time.monotonic() + FORK_WAIT_S
        with self.changed:
            while not self.forked and not self.gone and time.monotonic() < deadline:
                self.changed.wait(0.5)
            if not self.forked:
                self._give_up()
                return None
            return Forked(self.forked.pop(0), self)

    def exit_code(self, pid: int) -> int | None:
        """The rank's exit code as the template told it; None while it runs. Once the template
        is gone its ranks died with it (PR_SET_PDEATHSIG): one it did not tell of is told as
        killed, once it is gone."""
        with self.changed:
            code = self.exits.get(pid)
            if code is not None or not self.gone:
                return code
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -signal.SIGKILL
        except PermissionError:  # the pid is someone else's now
            return -signal.SIGKILL
        return None

    def wait_for_exit(self, timeout: float | None) -> None:
        with self.changed:
            self.changed.wait(0.05 if timeout is None else min(0.05, timeout))

    def kill(self) -> None:
        """SIGKILL the template, not waiting for its end (`retire` waits)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()

    def retire(self) -> None:
        """End the template (the ranks it forked die with it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)

    def _listen(self) -> None:
        """Reads the template's lines: ready, each fork's pid, each rank's exit."""
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            said = raw.decode(errors="replace").split()
            with self.changed:
                if said[:1] == ["failed"]:
                    self.gone = True
                elif said == ["ready"]:
                    self.ready.set()
                elif len(said) == 2 and said[0] == "pid":
                    self.forked.append(int(said[1]))
                elif len(said) == 3 and said[0] == "exit":
                    self.exits[int(said[1])] = int(said[2])
                self.changed.notify_all()
            if said[:1] == ["exit"]:
                self.on_exit()
        self._give_up()

    def _give_up(self) -> None:
        """The template is gone (or stuck): ranks start as new processes from now on."""
        self.retire()
        with self.changed:
            self.gone = True
            self.changed.notify_all()
        self.on_exit()


def _room(env: dict[str, str]) -> str:
    """Spaces for ENVIRONMENT_ROOM: the pod's environment's size again and 16 KB (a rank's is the
    pod's and the attempt's and rank's variables)."""
    size = sum(len(key) + len(value) + 2 for key, value in env.items())
    return " " * (size + (16 << 10))


def template_argv(command: list[str], cwd: Path) -> list[str] | None:
    """The command line of a template for the pod's command: the command itself, where it is
    `python script.py args` (directly or through /bin/sh -c without shell syntax) and the script
    imports torch or a framework built on it (TORCH_FAMILY). None otherwise: ranks start as new
    processes."""
    argv = spare_argv(command)
    if argv is None:
        return None
    line = shlex.split(command[2]) if command[:2] == ["/bin/sh", "-c"] else command
    return line if imports_torch(cwd / argv[0]) else None


TORCH_FAMILY = frozenset(("torch", "lightning", "pytorch_lightning", "accelerate", "transformers"))
"""Modules whose import is worth a template (each imports torch)."""


def imports_torch(script: Path) -> bool:
    """The script imports torch, or a framework on it, anywhere in its code."""
    try:
        tree = ast.parse(script.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] in TORCH_FAMILY for name in names):
            return True
    return False
