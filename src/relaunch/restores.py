"""Which tier served each restore of a checkpoint: the event the controller records when a rank
says it restored a step (a `Restored` message), and its reading back for reports. One place
writes the line and reads it, so the two cannot drift apart. Pure: no I/O."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["restore_event", "restores", "tiers_text"]

_EVENT: Final = re.compile(r"pod (\d+) rank (\d+) restored step (\d+) from (.+)")


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


def tiers_text(found: Iterable[dict[str, Any]]) -> str:
    """How many restores each tier served, most first: "3 from peer memory, 1 from storage"
    (a node's memory or disk counted as one tier, whichever node)."""
    tiers = Counter(re.sub(r" of \S+$", "", r["source"]) for r in found)
    return ", ".join(f"{n} from {tier}" for tier, n in tiers.most_common())
