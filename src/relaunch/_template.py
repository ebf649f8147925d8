"""A pod's rank template: one Python process per pod that does the heavy imports once (torch:
3.3 s of CPU a process on our CI machines) and forks each of the pod's ranks from there, in
milliseconds, instead of every rank importing them again in a process of its own. A pod of 4
ranks pays one import at its start instead of 4 at once on the same cores, and a rank restarted
in place starts without importing anything.

The launcher starts it as the rank's own command line (``python script.py args``: every rank of
a pod runs the same) with the pod's environment and RELAUNCH_RANK_TEMPLATE=serve; the
sitecustomize every rank loads (relaunch/_inject) calls `serve` before the script runs. It
imports the modules of ``RELAUNCH_SPARE_PRELOAD`` (default: a warm spare's, torch._dynamo too), never
starts CUDA (a rank forked from it starts CUDA itself, as a new process does), writes ``ready``
and serves the launcher, one JSON line a rank: ``{"env": {...}, "cwd": dir, "log": path,
"cgroup": path or null}``, answered ``pid PID`` once the rank is forked, and ``exit PID CODE``
when a rank it forked ends (CODE as ``subprocess`` gives it: negative for a signal). The ranks
are its children: it reaps them, and they die with it (PR_SET_PDEATHSIG), as it dies with the
launcher. The template itself never returns from `serve`: only the ranks it forks do.

A forked rank becomes the process the launcher would have started: its own session (process
group), its rank's cgroup joined before anything of the script runs, stdin from /dev/null,
stdout and stderr appended to its log, its environment and working directory; numpy's global
generator is seeded afresh where numpy was imported (Python's ``random`` is, on every fork).
Then `serve` returns, and the interpreter runs the script as ``__main__`` exactly as it would
have in a new process: the same command line, ``sys.argv``, ``sys.path`` and ``__main__``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import sys
from pathlib import Path

from relaunch._rendezvous import before_script
from relaunch._spare import DEFAULT_PRELOAD
from relaunch.containers import Cgroup
from relaunch.protocol.environment import Env

TEMPLATE_PRELOAD = DEFAULT_PRELOAD
"""What the template imports where the job does not say (RELAUNCH_SPARE_PRELOAD): a warm
spare's (torch._dynamo too: torch.optim imports it on first use, 1.7 s of a rank's start)."""
ENVIRONMENT_ROOM = "RELAUNCH_RANK_TEMPLATE_ROOM"
"""A variable of spaces the launcher adds to the template's environment: room for each rank's
own, larger one in the memory /proc/PID/environ reads (see _show_environment)."""
PR_SET_PDEATHSIG = 1


def serve() -> None:
    """The template's life (it never returns); each rank forked returns, to run the script."""
    try:
        _serve()
    except _Forked:
        return
    except BaseException as error:  # never run the script as the template
        with contextlib.suppress(Exception):
            _say(f"failed {type(error).__name__}: {error}")
        os._exit(1)
    os._exit(0)


def _serve() -> None:
    for name in os.environ.get(Env.SPARE_PRELOAD, TEMPLATE_PRELOAD).split(","):
        if name.strip():
            with contextlib.suppress(ImportError):
                importlib.import_module(name.strip())
    woken, wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    _say("ready")
    requests = b""
    while True:
        readable = select.select([0, woken], [], [])[0]  # retried on a signal (PEP 475)
        if woken in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(woken, 4096)
        _reap()
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 20)
        if not data:
            os._exit(0)  # the launcher closed its end: it is going, and the ranks with it
        requests += data
        while b"\n" in requests:
            line, requests = requests.split(b"\n", 1)
            identity = json.loads(line)
            identity["template"] = os.getpid()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(woken)
                os.close(wake)
                become(identity)
                raise _Forked  # out of the loop, past serve: the interpreter runs the script
            _say(f"pid {pid}")


class _Forked(Exception):
    """Raised in a forked rank once it is the rank: how it leaves the template's loop."""


def become(identity: dict[str, object]) -> None:
    """In the forked child: be the rank the launcher asked for (its script runs next)."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != identity["template"]:
        os._exit(1)  # the template died before this rank could die with it: the launcher is gone
    cgroup = identity.get("cgroup")
    if isinstance(cgroup, str):
        try:
            Cgroup(Path(cgroup)).join()  # made again where it went meanwhile, as a new process's
        except OSError as error:  # never run outside the rank's container: exit as a shell would
            _to_log(str(identity["log"]))
            print(f"relaunch: could not join the rank's cgroup {cgroup}: {error}", flush=True)
            os._exit(127)
    _to_log(str(identity["log"]))
    env = identity["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    if not _show_environment(env):
        print(
            "relaunch: this rank's environment is larger than its template's room for it: "
            f"/proc/{os.getpid()}/environ shows the template's",
            flush=True,
        )
    # a fresh process seeds numpy from the OS; a fork would repeat the template's generator
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()
    os.chdir(str(identity["cwd"]))
    before_script(env)


def _show_environment(env: dict[str, str]) -> bool:
    """What /proc/PID/environ shows (ps, psutil, a monitoring agent) made the rank's: the kernel
    shows the memory a process's environment started in, the template's for a forked rank. It
    is written over with the rank's (os.environ's strings live elsewhere once set again), the
    rest zeroed (a reader stops at two NULs); the template started with room to spare
    (ENVIRONMENT_ROOM). False where it does not fit, or the kernel does not say where it is."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (proc(5): 50, 51)
    except (OSError, IndexError, ValueError):
        return False
    block = b"".join(f"{key}={value}".encode() + b"\0" for key, value in env.items())
    if not 0 < start < end or len(block) + 1 > end - start:
        return False
    ctypes.memmove(start, block.ljust(end - start, b"\0"), end - start)
    return True


def _to_log(path: str) -> None:
    """stdin from /dev/null; stdout and stderr appended to the rank's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _reap() -> None:
    """Every rank that ended, told to the launcher with its exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())
