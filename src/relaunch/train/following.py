"""A rank following its job's membership (process-level recovery): the file the launcher writes
the controller's latest membership to, read when it changed, and waited on for the next
generation of the group that includes this rank. Standard library only."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from relaunch.protocol.plans import Membership, read_membership

__all__ = ["GroupLost", "Member", "changed_membership", "gasp_if_stale", "wait_for_membership"]

POLL_S = 0.02


class GroupLost(RuntimeError):
    """No working process group could be formed again within the wait (the controller's fallback
    takes over: a rank that raises this exits, and the next recovery level runs)."""


class Member(NamedTuple):
    """Who is waiting: its rank at start, its pod and its pod's container generation (None
    where it does not know them)."""

    rank: int
    pod: int | None
    pod_generation: int | None


def changed_membership(path: Path, seen_mtime: float) -> tuple[Membership | None, float]:
    """The membership in `path` if it changed since `seen_mtime` (one stat otherwise), and the
    modification time now seen."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None, seen_mtime
    if mtime == seen_mtime:
        return None, seen_mtime
    found = read_membership(path)
    return found, mtime if found is not None else seen_mtime


@contextlib.contextmanager
def gasp_if_stale(checkpoint: Any) -> Iterator[None]:
    """A recovery in which this process learns it is stale (GroupLost: its pod or its job was
    rebuilt, and relaunch stops it next) lets its dying gasp save first: the rebuild's new
    membership can come before relaunch's SIGTERM (`CheckpointManager.wait_for_stop`)."""
    try:
        yield
    except GroupLost:
        if checkpoint is not None:
            checkpoint.wait_for_stop()
        raise


def wait_for_membership(
    path: Path, newer_than: int, deadline: float, member: Member
) -> Membership | None:
    """The first membership of a generation above `newer_than` that includes `member`, before
    `deadline` (None: none came). GroupLost when the newer one says this process is stale (its
    pod was replaced) or leaves it out (scaled in). An order to issue a collective again is not a
    generation of the group: it is passed over."""
    while time.time() < deadline:
        found = read_membership(path)
        if found is not None and found.operator is None and found.generation > newer_than:
            if found.pods and member.pod is not None:
                current = found.pods.get(member.pod)
                if current is not None and current != member.pod_generation:
                    raise GroupLost(
                        f"rank {member.rank}: pod {member.pod} was replaced "
                        f"(generation {current}); this process is stale"
                    )
            if member.rank not in found.ranks:
                raise GroupLost(
                    f"rank {member.rank} is not a member of generation {found.generation} "
                    "(scaled in)"
                )
            return found
        time.sleep(POLL_S)
    return None
