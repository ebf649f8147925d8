"""Which tier served each restore of a checkpoint: the tiers' names (what a rank says when it
restored a step, a `Restored` message), and the restores read back from a job's record (its
`restored` events' fields) for reports and metrics. Pure: no I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from relaunch.events import EventKind, Recorded
from relaunch.protocol.datagrams import RestoreTier

__all__ = ["RestoreTier", "restores", "tiers_text"]


def restores(events: Iterable[Recorded]) -> list[dict[str, Any]]:
    """Every restore in a job's record, in order: when, pod, rank, step, tier, holder and its
    source in words."""
    return [
        {
            "at": event.at,
            **{key: event.fields[key] for key in ("pod", "rank", "step", "tier", "holder")},
            "source": event.fields["source"],
        }
        for event in events
        if event.kind is EventKind.RESTORED
    ]


def tiers_text(found: Iterable[dict[str, Any]]) -> str:
    """How many restores each tier served, most first: "3 from peer memory, 1 from storage"."""
    tiers = Counter(RestoreTier(r["tier"]).words for r in found)
    return ", ".join(f"{n} from {tier}" for tier, n in tiers.most_common())
