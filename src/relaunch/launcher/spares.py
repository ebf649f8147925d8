"""Warm spares: processes started ahead of need with the heavy imports done, which a restart
hands a rank's identity to instead of starting a process (see relaunch._spare)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from relaunch._spare import EVERY_GPU
from relaunch.containers import Cgroup
from relaunch.launcher.processes import in_container

__all__ = ["Spare", "SparePool", "spare_argv"]

READY_WAIT_S = 60.0
"""How long a rank's start waits for a spare that is still importing: as long as a new process
would spend on the same imports, at most (the rank template's wait, launcher.template)."""
HURRY_EVERY_S = 0.05


@dataclass
class Spare:
    proc: subprocess.Popen[bytes]
    ready: threading.Event
    cuda: str | None = None
    """The GPUs (CUDA_VISIBLE_DEVICES) it started CUDA on while it waited, once ready; None:
    it started no CUDA, and may become a rank that sees any GPUs."""
    answered: threading.Event = field(default_factory=threading.Event)
    """It said ready, or ended without: set either way."""

    def can_be(self, visible: str | None) -> bool:
        """It may become a rank that sees these GPUs (None: every GPU): CUDA, once started,
        keeps its GPUs."""
        return self.cuda is None or self.cuda == (visible or EVERY_GPU)

    def become(
        self, env: dict[str, str], argv: list[str], cwd: str, log: str
    ) -> subprocess.Popen[bytes]:
        """Hand the spare its identity: from now on it is that rank's process, writing its
        output to `log` (appending)."""
        assert self.proc.stdin is not None
        identity = {"env": env, "argv": argv, "cwd": cwd, "log": log}
        self.proc.stdin.write((json.dumps(identity) + "\n").encode())
        self.proc.stdin.close()
        return self.proc


class SparePool:
    """Keeps `size` spares started, for a command that one can become (`python script.py`).
    `refill(at_once=False)` starts one at a time, each once the one before is ready: N spares
    importing torch at once beside ranks that train starved the ranks (8 spares refilled after a
    job-level restart of 8 ranks on 2 cores stalled training past a 4 s hang window: a false
    hang). `on_ready` is called (from a thread) when one is ready."""

    def __init__(
        self,
        size: int,
        command: tuple[str, ...],
        on_ready: Callable[[], None] = lambda: None,
        container: Cgroup | None = None,
    ) -> None:
        self.size = size
        self.container = container
        """Where spares wait (the pod's `spares` cgroup); one that becomes a rank is moved to
        the rank's cgroup first."""
        self.argv = spare_argv(list(command))
        self.spares: list[Spare] = []
        self.on_ready = on_ready

    def refill(self, cwd: Path, env: dict[str, str], at_once: bool = True) -> None:
        if not self.size or self.argv is None:
            return
        self.spares = [sp for sp in self.spares if sp.proc.poll() is None]
        if self.container is not None:
            try:
                self.container.make()
            except OSError:
                return
        while len(self.spares) < self.size:
            if not at_once and not all(sp.ready.is_set() for sp in self.spares):
                return
            proc = subprocess.Popen(
                [sys.executable, "-m", "relaunch._spare"],
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=in_container(self.container),
            )
            spare = Spare(proc, threading.Event())
            threading.Thread(target=_await_ready, args=(spare, self.on_ready), daemon=True).start()
            self.spares.append(spare)

    def wants_more(self) -> bool:
        """Fewer spares than wanted are alive (one was taken, or died)."""
        if not self.size or self.argv is None:
            return False
        return sum(1 for sp in self.spares if sp.proc.poll() is None) < self.size

    def take(self, visible: str | None = None, wait: bool = True) -> Spare | None:
        """A spare that is ready and can be a rank that sees the GPUs `visible` (its
        CUDA_VISIBLE_DEVICES), or None. A ready spare that started CUDA on other GPUs is retired
        (the pod's GPUs changed since it started; a refill starts one on the new ones).

        Where none is ready but one is still importing (a fault soon after the pod or its
        refill started) and `wait`, that one is waited for, at the launcher's priority again:
        it is further along than a new process would be (a bench run whose standby launcher's
        spare was still importing started its rank cold: 3.7 s against 0.4)."""
        for spare in list(self.spares):
            if not spare.ready.is_set() or spare.proc.poll() is not None:
                continue
            self.spares.remove(spare)
            if spare.can_be(visible):
                return spare
            _end(spare)
        if not wait:
            return None
        importing = next((sp for sp in self.spares if sp.proc.poll() is None), None)
        if importing is None:
            return None
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:  # again and again: one just started lowers its own
            _hurry(importing)
            if importing.answered.wait(HURRY_EVERY_S):
                break
        if importing.ready.is_set() and importing.proc.poll() is None:
            self.spares.remove(importing)
            if importing.can_be(visible):
                return importing
            _end(importing)
        return None

    def kill(self) -> None:
        """SIGKILL every spare, waiting for none (retire waits): a process that imported torch
        takes tens of milliseconds to end, and ended one after another they added up."""
        for spare in self.spares:
            with contextlib.suppress(OSError):
                spare.proc.kill()

    def retire(self) -> None:
        self.kill()
        for spare in self.spares:
            _end(spare)
        self.spares = []


def _hurry(spare: Spare) -> None:
    """Every thread of the spare back to the launcher's priority (it imports SPARE_NICENESS
    lower, not to slow the ranks beside it; now a rank waits for it)."""
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{spare.proc.pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                os.setpriority(os.PRIO_PROCESS, int(task), ours)


def _end(spare: Spare) -> None:
    with contextlib.suppress(OSError):
        spare.proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        spare.proc.wait(timeout=5)


def _await_ready(spare: Spare, on_ready: Callable[[], None]) -> None:
    """Waits for the spare's `ready` (or `ready cuda GPUS`: see relaunch._spare)."""
    assert spare.proc.stdout is not None
    try:
        said = spare.proc.stdout.readline().decode(errors="replace").split()
        if said[:1] == ["ready"]:
            spare.cuda = said[2] if said[1:2] == ["cuda"] and len(said) > 2 else None
            spare.ready.set()
    finally:
        spare.answered.set()
    on_ready()  # the next spare may start (or, if this one died, another in its place)


def spare_argv(command: list[str]) -> list[str] | None:
    """`[script, args...]` when the command is `python script.py args` (directly or through
    /bin/sh -c without shell syntax): what a warm spare can become. None otherwise."""
    if command[:2] == ["/bin/sh", "-c"] and len(command) == 3:
        if any(ch in command[2] for ch in ";|&<>$`()*?~\n"):
            return None
        command = shlex.split(command[2])
    if len(command) < 2 or not Path(command[0]).name.startswith("python"):
        return None
    if not command[1].endswith(".py"):
        return None
    return command[1:]
