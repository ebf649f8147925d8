"""The fence a stale process stops at: once the controller has moved a pod off a node it declared
lost, the old generation's processes (the node may still run them) must not write a checkpoint
the new generation would load (relaunch.controller.fencing writes the fence)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from relaunch.protocol.environment import Env
from relaunch.protocol.layout import FENCE_FILE

__all__ = ["StaleProcess", "check_fence"]


class StaleProcess(RuntimeError):
    """This process belongs to a pod generation the job has left behind (its node was declared
    lost and the pod runs elsewhere now): it must not write a checkpoint."""


def check_fence() -> None:
    """Raise StaleProcess if the controller's fence says this process is stale. Outside relaunch
    (no RELAUNCH_SHARED_DIR) nothing is fenced."""
    shared = os.environ.get(Env.SHARED_DIR)
    if not shared:
        return
    try:
        fence = json.loads((Path(shared) / FENCE_FILE).read_text())
        oldest = int(fence["generations"][os.environ.get(Env.POD, "")])
    except (OSError, ValueError, KeyError, TypeError):
        return
    generation = int(os.environ.get(Env.GENERATION, "0"))
    if generation < oldest:
        raise StaleProcess(
            f"pod generation {generation} is stale (the pod was moved off a lost node and runs "
            f"as generation {oldest} now): checkpoint not written"
        )
