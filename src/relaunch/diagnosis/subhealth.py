"""Slow pods (MindCluster's SubHealthFault). In data-parallel training every rank steps at the
pace of the slowest, so step times cannot tell which one it is; where the ranks wait can. A rank
waiting for its peers in a collective sleeps; the slow one rarely waits. The launchers look at
each rank's main thread every progress interval (sleeping, or not: computing, runnable, in disk
I/O, stopped); a pod whose ranks are busy much more of the window than the other pods' is slow.

No alarm for a job that is uniformly slow (every pod busy: nobody waits) or uniformly fast
(every pod waits alike), nor while a recovery runs or before the ranks have a full window of
looks (the caller's part).

A pod slowed by its node's network is not found that way (every rank waits on the network
alike). Where nodes have real links, each node's agent times probes of its neighbours on the
data link: a degraded link queues them, so a node whose round trip is many times the other
nodes' has the slow link, and its pod is the slow one (`slow_links`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "MIN_LOOKS",
    "SLOW_LINK_FACTOR",
    "SLOW_LINK_FLOOR_MS",
    "SlowLink",
    "SlowPod",
    "look_interval_s",
    "slow_links",
    "slow_pods",
]

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


SLOW_LINK_FACTOR = 5.0
"""A node's data-link round trip this many times the other nodes' median is slow..."""
SLOW_LINK_FLOOR_MS = 5.0
"""... and at least this long (a busy machine answers probes a few milliseconds late)."""


@dataclass(frozen=True)
class SlowLink:
    pod: int
    rtt_ms: float
    peers_ms: float

    def describe(self) -> str:
        return (
            f"its node's data link is slow: probes took {self.rtt_ms:.0f} ms there, "
            f"{self.peers_ms:.1f} ms on the other pods' nodes"
        )


def slow_links(rtt_ms: Mapping[int, float]) -> list[SlowLink]:
    """The pods whose node's data-link round trip (by pod) is SLOW_LINK_FACTOR times the median
    of the others' and at least SLOW_LINK_FLOOR_MS. Needs two pods."""
    if len(rtt_ms) < 2:
        return []
    found = []
    for pod, rtt in sorted(rtt_ms.items()):
        peers = statistics.median(r for p, r in rtt_ms.items() if p != pod)
        if rtt >= max(SLOW_LINK_FACTOR * peers, SLOW_LINK_FLOOR_MS):
            found.append(SlowLink(pod, rtt, peers))
    return found
