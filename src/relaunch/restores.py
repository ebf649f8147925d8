"""Which tier served each restore of a checkpoint: the event the controller records when a rank
says it restored a step (a `Restored` message), and its reading back for reports. One place
writes the line and reads it, so the two cannot drift apart. Pure: no I/O."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["EVENT_LIKE", "restore_event", "restores", "tier_of", "tiers_text"]

_EVENT: Final = re.compile(r"pod (\d+) rank (\d+) restored step (\d+) from (.+)")
EVENT_LIKE: Final = "pod % rank % restored step % from %"
"""The events that may be restores, as SQL's LIKE finds them (`restores` then reads them)."""


def restore_event(pod: int, rank: int, step: int, source: str) -> str:
    """The record's line for a rank of `pod` that restored `step` from `source` (a tier: "peer
    memory of NODE", "local disk of NODE", "storage", or a healthy replica's memory)."""
    return f"pod {pod} rank {rank} restored step {step} from {source}"


def restores(events: Iterable[tuple[float, str]]) -> list[dict[str, Any]]:
    """Every restore in a job's record (its events: (when, text)), in order."""
    found = []
    for at, text in events:
        m = _EVENT.fullmatch(text)
        if m:
            pod, rank, step = int(m[1]), int(m[2]), int(m[3])
            found.append({"at": at, "pod": pod, "rank": rank, "step": step, "source": m[4]})
    return found


def tier_of(source: str) -> str:
    """The tier a restore's source names, whichever node or rank served: "peer memory", "local
    disk", "storage", "a healthy replica" (an online retry's, from a rank's memory)."""
    for prefix, tier in (
        ("peer memory of ", "peer memory"),
        ("local disk of ", "local disk"),
        ("the memory of rank ", "a healthy replica"),
    ):
        if source.startswith(prefix):
            return tier
    return source


def tiers_text(found: Iterable[dict[str, Any]]) -> str:
    """How many restores each tier served, most first: "3 from peer memory, 1 from storage"."""
    tiers = Counter(tier_of(r["source"]) for r in found)
    return ", ".join(f"{n} from {tier}" for tier, n in tiers.most_common())
