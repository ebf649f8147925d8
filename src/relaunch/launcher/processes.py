"""A launcher's processes: how they are started, signalled, watched and measured."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final, Protocol

import psutil

from relaunch.containers import Cgroup
from relaunch.diagnosis.errors import TAIL_LINES

__all__ = [
    "BUSY_STATES",
    "SPAWN_ERRORS",
    "STOPPED_STATES",
    "WORKING_STATES",
    "NotStarted",
    "RankLog",
    "RankProcess",
    "Worker",
    "cgroup_usage",
    "children_by_parent",
    "die_with_parent",
    "forget_stat",
    "group_alive",
    "in_container",
    "is_python",
    "python_process",
    "sample_busy",
    "signal_group",
    "spawn",
    "terminate",
    "tree_usage",
    "usage_changes",
]

SHELLS = {"sh", "dash", "bash", "zsh", "ksh"}


def die_with_parent() -> None:
    """In a child, before exec: the kernel SIGKILLs it when the launcher dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def in_container(cgroup: Cgroup | None) -> Callable[[], None]:
    """What a child runs before exec: it dies with the launcher and, where the pod is a
    cgroup, moves into `cgroup` first, so that everything it forks is born there. A child that
    cannot join is not started (the rank exits with 127 and says why) rather than run outside
    its container."""

    def prepare() -> None:
        die_with_parent()
        if cgroup is not None:
            cgroup.join()

    return prepare


SPAWN_ERRORS = (OSError, ValueError, subprocess.SubprocessError)
"""What starting a command raises where it cannot be started."""


def spawn(
    command: Sequence[str], env: dict[str, str], cwd: str, cgroup: Cgroup | None, log: BinaryIO
) -> subprocess.Popen[bytes]:
    """`command` started as a new process of a session of its own, in `cgroup` (None: none),
    its output to `log`, nothing on its input. Raises one of SPAWN_ERRORS where it cannot be."""
    return subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=in_container(cgroup),
    )


class RankProcess(Protocol):
    """What the launcher holds of a rank's process: a Popen (a process it started), a Forked
    (one the pod's rank template forked) or a NotStarted."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class NotStarted:
    """Stands in for the Popen of a command that could not be started: it has "exited", with
    127 (no such program) or 126 (not executable), as a shell would."""

    pid = 0
    stdout = None
    stdin = None

    def __init__(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def kill(self) -> None:
        return None


READ_AT_MOST: Final = 1 << 20
"""Bytes of a rank's new output one read takes at most: what a rank wrote beyond that since the
last read is left in its log file and not forwarded (only the newest lines are ever needed: the
tail its error is found in, and the lines the controller shows)."""
LINE_AT_MOST: Final = 1 << 16
"""Bytes of an unfinished line kept between reads: a rank that writes without a newline (a
progress bar's carriage returns, a stream of dots) costs its launcher at most this; beyond it,
the line is forwarded cut (the controller keeps 2000 characters of a line anyway)."""


class RankLog:
    """A rank's log file, which the rank's process writes its stdout and stderr to itself: no
    pipe, no thread, nothing that wakes the launcher per line, and a launcher that is slow to
    read never stalls the rank's writes. The launcher reads what was appended since its last
    read (from where this process's output began) when it reads the ranks' progress, and once
    more when the process exits."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.offset = os.fstat(self.fd).st_size
        self.partial = b""

    def read(self, final: bool = False) -> tuple[float, list[str]]:
        """The whole lines written since the last read (`final`: the unfinished last one too),
        and when the file was last written (the lines' time: a traceback printed before a
        rank stalled is timed when it was printed, not when it was read)."""
        try:
            status = os.fstat(self.fd)
            skipped = status.st_size - self.offset > READ_AT_MOST
            if skipped:
                self.offset, self.partial = status.st_size - READ_AT_MOST, b""
            data = os.pread(self.fd, max(0, status.st_size - self.offset), self.offset)
        except OSError:
            return time.time(), []
        self.offset += len(data)
        data, self.partial = self.partial + data, b""
        if skipped:  # the first line was cut: keep from the next whole one
            data = data.partition(b"\n")[2]
        lines = data.split(b"\n")
        last = lines.pop()
        if final and last:
            lines.append(last)
        else:
            self.partial = _shown(last, unfinished=True)
            if len(self.partial) > LINE_AT_MOST:
                lines.append(self.partial[:LINE_AT_MOST])
                self.partial = b""
        shown = (_shown(line) for line in lines)
        return status.st_mtime, [line.decode("utf-8", "replace") for line in shown]

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _shown(line: bytes, unfinished: bool = False) -> bytes:
    """What a terminal shows of a line: a carriage return goes back to its start, so a progress
    bar redrawn a thousand times is its last drawing. A line's own ending ("\\r\\n") is not a
    redraw; an unfinished line ending in one keeps it (the next drawing may follow)."""
    body = line if unfinished else line.removesuffix(b"\r")
    cut = body.rfind(b"\r", 0, len(body) - 1 if unfinished else len(body))
    return body[cut + 1 :] if cut >= 0 else body


@dataclass
class Worker:
    """One rank of the pod, in one attempt."""

    rank: int
    local_rank: int
    attempt: int
    proc: RankProcess
    output: RankLog | None
    """Its log, as written by its process (None: the command could not be started)."""
    stopping: bool = False
    reported: bool = False
    start_error: str | None = None
    """Why the command could not be started, if it could not."""
    ended_by: str | None = None
    """Why the launcher ended it on its own account (MindSpore's scheduler it needs is gone)."""
    usage: tuple[float, int] = (0.0, 0)
    """CPU seconds and I/O bytes of the rank's processes, as last sent."""
    started_at: float = field(default_factory=time.time)
    stepped: bool = False
    """The rank reported a training step (through the SDK) since it started."""
    alive_since_sample: bool = False
    """It reported a step or wrote output since its CPU time and I/O were last sampled."""
    pidfd: int | None = None
    """A descriptor that becomes readable when the process exits (None: not watched)."""
    tail: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    """Its last output lines, with when each was read: where its traceback is found."""
    stop_asked_at: float | None = None
    """When the launcher was told to stop it."""
    python_pid: int | None = None
    """Its Python process (the command's, or the first Python under a shell), once found."""
    stat_fd: int | None = None
    """/proc/PYTHON_PID/stat, kept open: each look is one read (it fails once that process is
    gone, even if its pid is reused)."""
    busy: int = 0
    samples: int = 0
    """Of `samples` looks at its main thread, how many found it not sleeping: computing,
    runnable, in disk I/O or stopped. A rank waiting for its peers in a collective sleeps."""
    working: int = 0
    """Of those looks, how many found it running, runnable or in disk I/O (not stopped): a
    rank starved of CPU, or blocked in an fsync on a busy disk, is working, not hung (R-25)."""
    working_sent: int = 0
    """`working` as the last usage sample sent it."""
    stopped: int = 0
    """Of those looks, how many found it stopped (SIGSTOP, a debugger)."""
    stopped_sent: int = 0

    @property
    def started(self) -> bool:
        return self.start_error is None


def signal_group(pid: int, signum: int) -> None:
    if pid <= 0:
        return  # killpg(0) would signal the launcher's own group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def terminate(leader: int) -> None:
    """SIGTERM for a rank's processes. A shell that runs the command is left to exit with its
    child: killed first, it would take the child with it (PR_SET_PDEATHSIG) before the child's
    dying gasp could save anything."""
    try:
        shell = psutil.Process(leader)
        children = shell.children(recursive=True) if shell.name() in SHELLS else []
    except psutil.Error:
        children = []
    if not children:
        signal_group(leader, signal.SIGTERM)
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.name() not in SHELLS:
                child.send_signal(signal.SIGTERM)


def group_alive(proc: RankProcess) -> bool:
    """Some process of the group led by `proc` still runs (zombies do not count)."""
    proc.poll()
    if proc.pid <= 0:
        return False
    try:
        members = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == proc.pid]
    except psutil.Error:
        return False
    return any(_running(p) for p in members)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_python(process: psutil.Process) -> bool:
    try:
        name = process.name()
        exe = os.path.basename(process.exe())
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return False
    return name.startswith("python") or exe.startswith("python")


def python_process(pid: int) -> psutil.Process | None:
    """A rank's Python: the process started (a `python` command), or the first Python under it
    (a shell, a wrapper)."""
    try:
        root = psutil.Process(pid)
        return next((p for p in (root, *root.children(recursive=True)) if is_python(p)), None)
    except psutil.Error:
        return None


BUSY_STATES: Final = frozenset((b"R", b"D", b"T", b"t"))
"""Main-thread states that are not waiting: running or runnable, disk I/O, stopped."""
WORKING_STATES: Final = frozenset((b"R", b"D"))
"""Main-thread states that show a rank at work: running or runnable, waiting for the disk."""
STOPPED_STATES: Final = frozenset((b"T", b"t"))
"""Stopped by a signal (SIGSTOP) or a debugger: whatever phase it said it was in, it does not
progress (a rank stopped in a checkpoint save is not saving)."""


def sample_busy(worker: Worker) -> None:
    """One look at the rank's main thread (its state in /proc/PID/stat: one read)."""
    if worker.stat_fd is None:
        if worker.python_pid is None:
            found = python_process(worker.proc.pid)
            if found is None:
                return
            worker.python_pid = found.pid
        try:
            worker.stat_fd = os.open(f"/proc/{worker.python_pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
    try:
        data = os.pread(worker.stat_fd, 1024, 0)
        end = data.rindex(b")")  # the name in brackets may hold any character
        state = data[end + 2 : end + 3]
    except (OSError, ValueError):
        forget_stat(worker)
        return
    worker.samples += 1
    worker.busy += state in BUSY_STATES
    worker.working += state in WORKING_STATES
    worker.stopped += state in STOPPED_STATES


def forget_stat(worker: Worker) -> None:
    """Close the rank's /proc stat descriptor (it exited)."""
    if worker.stat_fd is not None:
        with contextlib.suppress(OSError):
            os.close(worker.stat_fd)
        worker.stat_fd = None


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children, from one walk of the process table."""
    children: dict[int, list[int]] = {}
    for process in psutil.process_iter(["ppid"]):
        parent = process.info.get("ppid")
        if parent:
            children.setdefault(int(parent), []).append(process.pid)
    return children


def cgroup_usage(cgroup: Cgroup) -> tuple[float, int] | None:
    """CPU seconds and bytes read and written by a rank's processes, from its cgroup: CPU from
    `cpu.stat` (every process that ever ran there, helpers included), I/O from `io.stat` where
    the io controller is on, else summed over the pids in `cgroup.procs` (no walk of the
    process table). None if the cgroup is gone."""
    cpu = cgroup.cpu_seconds()
    if cpu is None:
        return None
    io = cgroup.io_bytes()
    if io is None:
        io = 0
        for pid in cgroup.procs():
            with contextlib.suppress(psutil.Error, AttributeError):
                counters = psutil.Process(pid).io_counters()
                io += int(getattr(counters, "read_chars", 0)) + int(
                    getattr(counters, "write_chars", 0)
                )
    return round(cpu, 2), io


def tree_usage(pid: int, children: dict[int, list[int]]) -> tuple[float, int] | None:
    """CPU seconds (user + system) and bytes read and written, summed over a process and its
    descendants; None if it is gone."""
    family, pending = [], [pid]
    while pending:
        current = pending.pop()
        family.append(current)
        pending.extend(children.get(current, ()))
    cpu, io, seen = 0.0, 0, False
    for member in family:
        try:
            process = psutil.Process(member)
            with process.oneshot():
                times = process.cpu_times()
                cpu += times.user + times.system
                counters = process.io_counters()
                io += int(getattr(counters, "read_chars", 0)) + int(
                    getattr(counters, "write_chars", 0)
                )
            seen = True
        except (psutil.Error, AttributeError):
            continue
    return (round(cpu, 2), io) if seen else None


def usage_changes(
    silent: list[Worker], rank_cgroup: Callable[[int], Cgroup | None], by_tree: bool
) -> tuple[dict[int, tuple[float, int]], dict[int, int], dict[int, int]]:
    """What changed of each silent rank since the last sample: its CPU time and I/O (its
    cgroup's, or, `by_tree`, its whole process tree's), how many looks found it working and
    how many stopped; ranks where nothing changed are left out."""
    children = children_by_parent() if by_tree else {}
    ranks: dict[int, tuple[float, int]] = {}
    working: dict[int, int] = {}
    stopped: dict[int, int] = {}
    for worker in silent:
        cgroup = rank_cgroup(worker.rank)
        usage = (
            cgroup_usage(cgroup) if cgroup is not None else tree_usage(worker.proc.pid, children)
        )
        looks = worker.working - worker.working_sent
        worker.working_sent = worker.working
        halted = worker.stopped - worker.stopped_sent
        worker.stopped_sent = worker.stopped
        if usage is not None and (usage != worker.usage or looks or halted):
            worker.usage = usage
            ranks[worker.rank] = usage
            if looks:
                working[worker.rank] = looks
            if halted:
                stopped[worker.rank] = halted
    return ranks, working, stopped
