"""Slow pods (MindCluster's SubHealthFault). In data-parallel training every rank steps at the
pace of the slowest, so step times cannot tell which one it is; where the ranks wait can. A rank
waiting for its peers in a collective sleeps; the slow one rarely waits. The launchers look at
each rank's main thread every progress interval (sleeping, or not: computing, runnable, in disk
I/O, stopped); a pod whose ranks are busy much more of the window than the other pods' is slow.

No alarm for a job that is uniformly slow (every pod busy: nobody waits) or uniformly fast
(every pod waits alike), nor while a recovery runs or before the ranks have a full window of
looks (the caller's part)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["MIN_LOOKS", "SlowPod", "look_interval_s", "slow_pods"]

MIN_LOOKS = 10
"""A rank needs this many looks in the window before its share counts (fewer are too coarse
for the margin: one look is a tenth of the share)."""


def look_interval_s(window_s: float) -> float:
    """The longest interval between looks at which a window holds twice MIN_LOOKS, so that its
    jitter never leaves one short (with exactly MIN_LOOKS expected, a late look cost a whole
    window). Infinite where slow-pod detection is off (a window of 0)."""
    return window_s / (2 * MIN_LOOKS) if window_s > 0 else float("inf")


@dataclass(frozen=True)
class SlowPod:
    pod: int
    busy: float
    """The share of the window its ranks were not waiting."""
    peers: float
    """The median share of the other pods."""

    def describe(self) -> str:
        return (
            f"its ranks were busy {self.busy:.0%} of the window, the other pods' {self.peers:.0%} "
            "(they wait for it)"
        )


def slow_pods(busy: Mapping[int, float], margin: float) -> list[SlowPod]:
    """The pods busy at least `margin` more than the median of the others, where the others
    wait at least `margin` of the time (else the job is uniformly slow). Needs two pods."""
    if len(busy) < 2:
        return []
    found = []
    for pod, share in sorted(busy.items()):
        peers = statistics.median(s for p, s in busy.items() if p != pod)
        if share - peers >= margin and peers <= 1.0 - margin:
            found.append(SlowPod(pod, share, peers))
    return found
