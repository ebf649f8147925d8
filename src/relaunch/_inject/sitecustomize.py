"""Loaded into every Python process a relaunch launcher starts (it puts this folder on PYTHONPATH).

Two things, both for fault handling, neither visible to a script that does not look:
- the process dies with its parent (PR_SET_PDEATHSIG), so that no worker outlives its launcher;
- SIGUSR2 makes the process exit with the code in $RELAUNCH_INJECT_DIR/<pid>: how a fault plan's
  `process-exit` makes a real process really exit with the code asked for.
And in a pod's rank template (RELAUNCH_RANK_TEMPLATE=serve), the template's loop: only the ranks
it forks come back from it, to run the script.
"""

import os
import signal

INJECT_DIR = "RELAUNCH_INJECT_DIR"
"""protocol.environment.Env.INJECT_DIR, spelled out: this runs before anything in every worker,
which must not pay for importing relaunch (tests/test_purity.py checks the two agree)."""
RANK_TEMPLATE = "RELAUNCH_RANK_TEMPLATE"
"""protocol.environment.Env.RANK_TEMPLATE: "serve" in a pod's rank template (relaunch._template),
which imports torch once here and forks the pod's ranks; each returns here and runs the script."""


def _die_with_parent() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)
    except (OSError, AttributeError):
        pass


def _exit_on_request(signum: int, frame: object) -> None:
    code = 1
    try:
        with open(os.path.join(os.environ[INJECT_DIR], str(os.getpid()))) as f:
            code = int(f.read().strip() or 1)
    except (KeyError, OSError, ValueError):
        pass
    os._exit(code)


if os.environ.get(INJECT_DIR):
    _die_with_parent()
    try:
        signal.signal(signal.SIGUSR2, _exit_on_request)
    except ValueError:  # not the main thread: leave the signal alone
        signal.getsignal(signal.SIGUSR2)

if os.environ.get(RANK_TEMPLATE) == "serve":
    try:
        from relaunch._template import serve
    except (
        Exception
    ) as error:  # never run the script as the template: the launcher starts ranks cold
        print(f"failed: relaunch's rank template cannot start here: {error}", flush=True)
        os._exit(3)
    serve()
