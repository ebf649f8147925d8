"""A warm spare: a Python process started ahead of need, with its heavy imports done, that waits
for an identity and then runs a training script as if it had been started for it.

The launcher starts it as ``python -m relaunch._spare`` (stdin and stdout piped). It imports the
modules of ``RELAUNCH_SPARE_PRELOAD`` (default: torch, torch.distributed, DDP and
torch._dynamo, which torch.optim imports on first use: 1.7 s on our CI machines), writes ``ready``, and reads one JSON
line: ``{"env": {...}, "argv": [script, args...], "cwd": dir, "log": path}``. Then it becomes
that process: its stdout and stderr the rank's log (appended to, as a process the launcher
starts writes it), environment, working directory and ``sys.argv`` replaced, the script run as
``__main__``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import sys

from relaunch.protocol.environment import Env

DEFAULT_PRELOAD = "torch,torch.distributed,torch.nn.parallel,torch._dynamo"


def main() -> None:
    for name in os.environ.get(Env.SPARE_PRELOAD, DEFAULT_PRELOAD).split(","):
        if name.strip():
            with contextlib.suppress(ImportError):
                importlib.import_module(name.strip())
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        return  # the launcher went away or retired the spare
    identity = json.loads(line)
    if identity.get("log"):
        sys.stdout.flush()
        sys.stderr.flush()
        log = os.open(identity["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    os.environ.clear()
    os.environ.update(identity["env"])
    os.chdir(identity["cwd"])
    argv = list(identity["argv"])
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
