"""Every rank's Python stack, for a hang's diagnosis: py-spy reads a process's frames from outside
(without stopping it: `--nonblocking`; a SIGSTOPped rank can be read too), and psutil says whether
the process is stopped, sleeping or running."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from relaunch.diagnosis import Frame, RankStack, StackGroup, group_stacks
from relaunch.launcher.processes import python_process

__all__ = ["capture", "capture_aside", "py_spy"]


def py_spy() -> str | None:
    """py-spy next to relaunch's Python (a venv's bin), else on PATH."""
    here = str(Path(sys.executable).parent)
    return shutil.which("py-spy", path=os.pathsep.join((here, os.environ.get("PATH", ""))))


def capture(ranks: dict[int, int], timeout_s: float) -> tuple[StackGroup, ...]:
    """The stack of each rank's Python process (`ranks`: rank -> the pid relaunch started), read
    in parallel, each within `timeout_s`; alike ones once, with their ranks."""
    if not ranks:
        return ()
    tool = py_spy()
    with ThreadPoolExecutor(max_workers=min(8, len(ranks))) as pool:
        return group_stacks(
            pool.map(lambda item: _one(item[0], item[1], tool, timeout_s), ranks.items())
        )


def capture_aside(
    ranks: dict[int, int], timeout_s: float, then: Callable[[tuple[StackGroup, ...]], None]
) -> None:
    """`capture` on a thread of its own, its stacks handed to `then` (py-spy takes tens of ms a
    rank: the launcher's loop keeps serving meanwhile)."""
    threading.Thread(target=lambda: then(capture(ranks, timeout_s)), daemon=True).start()


def _one(rank: int, pid: int, tool: str | None, timeout_s: float) -> RankStack:
    process = python_process(pid)
    if process is None:
        if not psutil.pid_exists(pid):  # it ended between the request and the look
            return RankStack(rank, pid, "gone", error="the process exited")
        return RankStack(rank, pid, "gone", error="no Python process in the rank's process tree")
    try:
        state = str(process.status())
    except psutil.Error:
        return RankStack(rank, process.pid, "gone", error="the process exited")
    if tool is None:
        return RankStack(rank, process.pid, state, error="py-spy is not installed")
    found = _dump(rank, process.pid, state, tool, timeout_s, blocking=False)
    if not found.frames and state not in ("stopped", "tracing-stop"):
        # A running process read without pausing it can yield no frames (it moved meanwhile):
        # pause it for the read (a few ms). A stopped one must not be attached to.
        found = _dump(rank, process.pid, state, tool, timeout_s, blocking=True)
    return found


def _dump(
    rank: int, pid: int, state: str, tool: str, timeout_s: float, blocking: bool
) -> RankStack:
    command = [tool, "dump", "--pid", str(pid), "--json"]
    if not blocking:
        command.append("--nonblocking")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return RankStack(rank, pid, state, error=f"py-spy: {error}")
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        return RankStack(rank, pid, state, error=f"py-spy: {why[:300]}")
    try:
        threads = json.loads(done.stdout)
    except ValueError:
        return RankStack(rank, pid, state, error="py-spy printed no JSON")
    return _parsed(rank, pid, state, threads)


def _parsed(rank: int, pid: int, state: str, threads: list[dict[str, Any]]) -> RankStack:
    text = []
    main: tuple[Frame, ...] = ()
    for i, thread in enumerate(threads):
        frames = tuple(
            Frame(str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line") or 0))
            for f in thread.get("frames", [])
        )
        name = thread.get("thread_name") or f"thread {thread.get('thread_id')}"
        activity = "active" if thread.get("active") else "idle"
        text.append(f"Thread {name} ({activity}):")
        text.extend(f"    {frame}" for frame in frames)
        if name == "MainThread" or (i == 0 and not main):
            main = frames
    return RankStack(rank, pid, state, main, "\n".join(text))
