"""Reentrancy helpers (R-05): an in-place recovery or a restart upon suspension runs the start
command again in the same container, so setup that already happened there must not run twice."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path
from typing import TypeVar

from relaunch.protocol.environment import Env

__all__ = ["once_per_container", "recreate_shared_memory"]

T = TypeVar("T")


def _container_dir() -> Path:
    return Path(os.environ.get(Env.WORKDIR, "."))


def once_per_container(name: str, setup: Callable[[], object]) -> bool:
    """Run `setup` once in this container (the pod's work directory), whichever of its processes
    gets there first; the others wait for it. Skipped after an in-place restart
    (MA_PROC_START_CNT > 1, work directory kept); run again after a rescheduling (new container).
    Returns True if this call ran it."""
    directory = _container_dir()
    directory.mkdir(parents=True, exist_ok=True)
    done = directory / f".relaunch-once-{name}.done"
    with open(directory / f".relaunch-once-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if done.exists():
                return False
            setup()
            done.write_text(os.environ.get("MA_PROC_START_CNT", "1"))
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def recreate_shared_memory(name: str, size: int) -> shared_memory.SharedMemory:
    """Named shared memory, created fresh even if a previous run in this container left a segment
    of that name behind (the usual crash after an in-place restart)."""
    try:
        stale = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        pass
    else:
        stale.close()
        stale.unlink()
    return shared_memory.SharedMemory(name=name, create=True, size=size)
