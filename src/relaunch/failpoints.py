"""Failpoints: named places where a test can make a relaunch process die on purpose.

A controller killed at any point of a recovery must carry on when it is resumed, with exactly one
record per fault. To test that at the points that matter (right after a fault is stored, right
after its decision is stored, in the middle of a stop, ...), the process reads one name from
`RELAUNCH_FAILPOINT` when it starts and SIGKILLs itself the first time it reaches a place of that
name, as etcd's gofail and FoundationDB's buggify do. Unset (always, outside tests) it costs one
string comparison per place reached.

The places, in the order a recovery reaches them: `fault-plan-due` (a planned fault is due, not
yet injected), `fault-stored` (the fault and its pending decision are committed),
`decision-stored` (the recovery record and the desired state it asks for are committed),
`membership-stored` (a process-level recovery's group generation is committed, not yet sent),
`stopping` (the old processes were told to stop), `starting` (the new processes were told to
start), `recovered` (progress resumed and the record was settled).
"""

from __future__ import annotations

import os
import signal
from typing import Final

from relaunch.protocol.environment import Env

__all__ = ["PLACES", "reach"]

PLACES: Final = (
    "fault-plan-due",
    "fault-stored",
    "decision-stored",
    "membership-stored",
    "stopping",
    "starting",
    "recovered",
)

_ARMED: Final = os.environ.get(Env.FAILPOINT, "")


def reach(place: str) -> None:
    """SIGKILL this process if `place` is the armed failpoint."""
    if _ARMED and place == _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)
