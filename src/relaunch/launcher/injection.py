"""A fault plan's process faults, made real on a pod's ranks: an exit with a code (the rank's own
Python exits, through relaunch._inject's handler), a hang (SIGSTOP), or a slow pod (a CPU
throttle's duty cycle on every rank of the pod).

    why_not = inject(worker, message, pod_workers, inject_dir, pod, running)
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import psutil

from relaunch.launcher.processes import Worker, is_python, signal_group
from relaunch.protocol.integrity import CORRUPTION_SUFFIX
from relaunch.protocol.messages import InjectProcessFault

__all__ = ["SLOW_PERIOD_S", "inject", "slow_down"]

SLOW_PERIOD_S: Final = 0.1
"""A fault plan's `slow`: the period of its duty cycle."""


def inject(
    worker: Worker | None,
    message: InjectProcessFault,
    pod: Sequence[Worker],
    inject_dir: Path,
    pod_index: int,
    running: Callable[[], bool],
) -> str | None:
    """The fault on `worker` (a slow one on all of `pod`); why it could not fire, or None."""
    if worker is None or not worker.started:
        return f"rank {message.rank} has no process in pod {pod_index}"
    if worker.proc.poll() is not None:
        return f"rank {worker.rank} has exited (code {worker.proc.returncode})"
    if message.kind == "hang":
        signal_group(worker.proc.pid, signal.SIGSTOP)
        return None
    if message.kind == "corrupt":  # carried out inside the rank, by its training SDK
        return _ask_to_corrupt(worker, message.corruption, inject_dir)
    if message.kind == "slow":
        live = [w for w in pod if w.started and w.proc.poll() is None]
        threading.Thread(
            target=slow_down,
            args=(live, message.factor, message.duration_s, running),
            daemon=True,
        ).start()
        return None
    try:
        root = psutil.Process(worker.proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return f"rank {worker.rank} has exited"
    for process in [p for p in tree if is_python(p)] or tree[:1]:
        (inject_dir / str(process.pid)).write_text(str(message.exit_code))
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGUSR2)
    return None


def _ask_to_corrupt(worker: Worker, corruption: str, inject_dir: Path) -> str | None:
    """Leaves the request where the rank's SDK looks after each step (protocol.integrity): its
    Python processes' `<pid>.corrupt`."""
    try:
        root = psutil.Process(worker.proc.pid)
        python = [p for p in [root, *root.children(recursive=True)] if is_python(p)]
    except psutil.NoSuchProcess:
        return f"rank {worker.rank} has exited"
    if not python:
        return f"rank {worker.rank} runs no Python process to corrupt"
    for process in python:
        (inject_dir / f"{process.pid}{CORRUPTION_SUFFIX}").write_text(corruption)
    return None


def slow_down(
    workers: list[Worker],
    factor: float,
    duration_s: float | None,
    running: Callable[[], bool] = lambda: True,
) -> None:
    """A CPU throttle's duty cycle on the pod's processes (a fault plan's `slow`): each period
    (SLOW_PERIOD_S on average, drawn anew each time as a busy node's scheduler would give it:
    not in step with anything that samples them) they run 1/factor of it and are stopped the
    rest, until `duration_s` has passed or they are stopped or gone, or the launcher ends."""
    end = time.time() + duration_s if duration_s is not None else float("inf")
    draw = random.Random()
    try:
        while running() and time.time() < end:
            live = [w for w in workers if not w.stopping and w.proc.poll() is None]
            if not live:
                return
            period = draw.uniform(0.5, 1.5) * SLOW_PERIOD_S
            run = period / factor
            for worker in live:
                signal_group(worker.proc.pid, signal.SIGSTOP)
            time.sleep(period - run)
            for worker in live:
                signal_group(worker.proc.pid, signal.SIGCONT)
            time.sleep(run)
    finally:
        for worker in workers:
            if worker.proc.poll() is None:
                signal_group(worker.proc.pid, signal.SIGCONT)
