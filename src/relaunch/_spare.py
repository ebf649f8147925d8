"""A warm spare: a Python process started ahead of need, with its heavy imports done, that waits
for an identity and then runs a training script as if it had been started for it.

The launcher starts it as ``python -m relaunch._spare`` (stdin and stdout piped). It imports the
modules of ``RELAUNCH_SPARE_PRELOAD`` (default: torch, torch.distributed, DDP and
torch._dynamo, which torch.optim imports on first use: 1.7 s on our CI machines; torchrun's
``record`` and relaunch's training SDK), writes ``ready``, and reads one JSON line:
``{"env": {...}, "argv": [script, args...], "cwd": dir, "log": path}``. It waits at a lower
CPU priority (SPARE_NICENESS) where it can raise it back, so that a refill does not slow the
ranks training beside it, and trains at the launcher's. (``ready cuda GPUS`` where it also started
CUDA on those GPUs: see below.) Then it becomes
that process: its stdout and stderr the rank's log (appended to, as a process the launcher
starts writes it), environment, working directory and ``sys.argv`` replaced, the script run as
``__main__``.

Where its pod's chips are GPUs (``CUDA_VISIBLE_DEVICES``, as every engine gives a pod its chips'),
a spare also starts CUDA while it waits (``ready_cuda``): the driver, and where the pod sees one
GPU, that GPU's context (the 5.6 s a cold rank spent before its model was on an H100). The rank it
becomes finds CUDA started on the same GPUs; the launcher hands a spare only to a rank that sees
the GPUs the spare started CUDA with (``RELAUNCH_SPARE_CUDA=0`` turns it off).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import runpy
import sys

from relaunch._rendezvous import before_script
from relaunch.protocol.environment import Env

DEFAULT_PRELOAD = ",".join(
    (
        "torch",
        "torch.distributed",
        "torch.nn.parallel",
        "torch._dynamo",
        "torch.distributed.elastic.multiprocessing.errors",
        "relaunch.train",
        "relaunch.train.distributed",
        "relaunch.train.group",
    )
)
"""What a spare and a rank template import where the job does not say: torch's heavy modules,
then what a script that uses torchrun's ``record`` or relaunch's SDK imports next (0.12 s more
of a rank's start once torch is in, measured with torch 2.13 on the bench machine; a forked
replacement's process-in-place went from 0.56-0.64 s to 0.30-0.40 s in three runs each)."""
CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
EVERY_GPU = "all"
"""What a spare says it started CUDA on where no CUDA_VISIBLE_DEVICES limits it (every GPU)."""
CUDA_FAILED: list[str] = []
"""Why CUDA could not be started while waiting, if it could not."""
SPARE_REFUSED = 75
"""A spare's exit code when handed a rank it cannot be (EX_TEMPFAIL)."""
SPARE_NICENESS = 10
"""How much lower a spare's CPU priority is while it imports and waits than the rank it becomes:
a spare refilled after a restart (importing torch takes seconds of CPU) must not slow the ranks
training beside it on the same cores. Nice 10 has about a tenth of nice 0's share of a busy
core; on an idle one a spare gets it all."""
CAP_SYS_NICE = 23
"""The capability that lets a process raise its priority back (linux/capability.h)."""


def main() -> None:
    back_to = _lower_priority()
    for name in os.environ.get(Env.SPARE_PRELOAD, DEFAULT_PRELOAD).split(","):
        if name.strip():
            with contextlib.suppress(ImportError):
                importlib.import_module(name.strip())
    readied = ready_cuda()
    sys.stdout.write("ready\n" if readied is None else f"ready cuda {readied}\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        return  # the launcher went away or retired the spare
    identity = json.loads(line)
    if back_to is not None:
        _restore_priority(back_to)  # a rank now: it trains at the launcher's priority
    if identity.get("log"):
        sys.stdout.flush()
        sys.stderr.flush()
        log = os.open(identity["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    for error in CUDA_FAILED:
        print(
            f"relaunch: this warm spare could not start CUDA while it waited: {error}", flush=True
        )
    visible = identity["env"].get(CUDA_VISIBLE) or EVERY_GPU
    if readied is not None and visible != readied:
        # CUDA cannot start again on other GPUs: the launcher checks this before it hands a
        # spare on (SparePool.take); a spare told otherwise ends rather than train elsewhere
        print(
            f"relaunch: a warm spare that started CUDA on GPUs {readied} cannot be a rank that "
            f"sees {visible}",
            flush=True,
        )
        sys.exit(SPARE_REFUSED)
    os.environ.clear()
    os.environ.update(identity["env"])
    os.chdir(identity["cwd"])
    before_script(os.environ)
    argv = list(identity["argv"])
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def ready_cuda() -> str | None:
    """CUDA started ahead of the rank where torch is imported and the pod's chips are GPUs
    (CUDA_VISIBLE_DEVICES), or the job asks for it (RELAUNCH_SPARE_CUDA=1: pods that share the
    machine's GPUs, on simulated chips); never with RELAUNCH_SPARE_CUDA=0. The driver, and with
    one visible GPU its context and a first allocation (a rank of a one-GPU pod takes device 0
    of what it sees). The GPUs it started on (CUDA_VISIBLE_DEVICES, or EVERY_GPU), or None where
    it started nothing (not wanted, no CUDA, or CUDA failed: the rank then starts it itself, as
    a cold process does)."""
    wanted = os.environ.get(Env.SPARE_CUDA, "")
    visible = os.environ.get(CUDA_VISIBLE, "")
    torch = sys.modules.get("torch")
    if torch is None or wanted == "0" or not (visible or wanted == "1"):
        return None
    try:
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()
        if torch.cuda.device_count() == 1:
            torch.cuda.set_device(0)
            torch.empty(1, device="cuda")
    except Exception as error:  # any CUDA failure: the rank starts it cold, as a new process would
        CUDA_FAILED.append(str(error))  # said in the rank's log (stdout is the launcher's now)
        return None
    return visible or EVERY_GPU


def _lower_priority() -> int | None:
    """Lower this process's CPU priority by SPARE_NICENESS, if it may raise it back once it
    becomes a rank (CAP_SYS_NICE, or RLIMIT_NICE up to its niceness now); the niceness to go
    back to, or None where it stays as it is (a spare that could not raise it back would train
    slowly)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    lower = min(19, before + SPARE_NICENESS)
    if lower == before or not _may_raise_to(before):
        return None
    os.setpriority(os.PRIO_PROCESS, 0, lower)
    return before


def _may_raise_to(niceness: int) -> bool:
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for field in status:
            if field.startswith("CapEff:") and int(field.split()[1], 16) >> CAP_SYS_NICE & 1:
                return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= niceness


def _restore_priority(niceness: int) -> None:
    """Every thread back to `niceness` (Linux keeps a niceness per thread: the threads the
    imports started inherited the spare's)."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):
            os.setpriority(os.PRIO_PROCESS, int(task), niceness)


if __name__ == "__main__":
    main()
