"""A rank that meets its group through rank 0's store waits for that store to listen before it
connects, where relaunch starts the rank's script (a warm spare, a rank forked from the pod's
template) or forms its group (train.group).

Why: torch's TCPStore client that finds nothing listening yet backs off before it tries again
(0.3-0.5 s measured on torch 2.13 when the server came 10-200 ms after the client), and the
server waits for its clients meanwhile. A whole-job warm restart hands every rank its identity
at once, so a rank other than 0 is often first; it spent most of the restart's 0.6 s
rendezvous (issue 75) in that backoff. Polled every few milliseconds instead, it connects within
milliseconds of the store's start. The poll's own connection is closed at once, which the store
(libuv's and the classic one) takes as a client that left.

Bounded (STORE_WAIT_S, RELAUNCH_STORE_WAIT_S): a script that meets its group elsewhere loses at
most the bound, then connects as it would have, with torch's own timeout."""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping

from relaunch.protocol.environment import Env

STORE_WAIT_S = 2.0
"""How long a rank other than 0 waits for rank 0's store at most before its script runs: about
a warm rank 0's way to its store (tens of milliseconds) many times over, and a backoff's length
or two where the script never serves one."""
POLL_S = 0.002


def wait_for_store(host: str, port: int, bound_s: float) -> bool:
    """True once something listens at host:port (within `bound_s`); False past it."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            left = max(0.05, deadline - time.monotonic())
            with socket.create_connection((host, port), timeout=left):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def before_script(env: Mapping[str, str]) -> None:
    """Where the rank's script will meet its group at MASTER_ADDR:MASTER_PORT as a client
    (torch's env:// rendezvous: RANK not 0, no agent store) and not through a membership
    (process-level recovery forms its group at the membership's store, train.group waits
    for that one): wait for rank 0's store first."""
    if env.get(Env.RANK, "0") == "0" or Env.MEMBERSHIP in env:
        return
    if env.get(Env.USE_AGENT_STORE) == "True":
        return
    host, port = env.get(Env.MASTER_ADDR), env.get(Env.MASTER_PORT, "")
    bound = float(env.get(Env.STORE_WAIT, STORE_WAIT_S))
    if host and port.isdigit() and bound > 0:
        wait_for_store(host, int(port), bound)
