"""Goodput: where a job's wall time went. Every instant from the job's start to its end (or now)
is either productive or lost to one cause; where causes overlap (a fault during a recovery) the
instant counts once, for the cause listed first in CAUSES. So the figures add up to the wall time
and the effective training time ratio (ETTR) is productive / wall.

Causes, from what the store records:
- startup: the job's start until its first step (jobs that report steps, through the SDK);
- detection: a fault happened, until relaunch detected it;
- recovery: detected until progress resumed (stopping, restarting, the rendezvous, loading);
- recomputed: after progress resumed, until the job's newest step passes the step it had
  reached when the fault happened (the steps since the checkpoint, done again; jobs that report
  steps);
- unrecovered: a fault whose recovery did not bring progress back (the job failed or stopped);
- slow: a slow pod held the job back, from the window in which it was seen slow until it was
  detected (its "detection").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["CAUSES", "Goodput", "Recovery", "goodput"]

CAUSES: Final = ("detection", "recovery", "recomputed", "unrecovered", "slow", "startup")


@dataclass(frozen=True)
class Recovery:
    """One recovery, as recorded: when its fault happened, was detected and progress resumed
    (None: it never did)."""

    fault_at: float
    detected_at: float
    resumed_at: float | None
    slow: bool = False
    """A slow pod's fault: the time until detection was spent slow, not stopped."""


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    lost_s: dict[str, float]

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive / wall (1.0 for a job with no wall time)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 1.0

    def to_json(self) -> dict[str, object]:
        return {
            "wall_s": round(self.wall_s, 3),
            "productive_s": round(self.productive_s, 3),
            "ettr": round(self.ettr, 4),
            "lost_s": {cause: round(s, 3) for cause, s in self.lost_s.items()},
        }


def goodput(
    start: float,
    end: float,
    recoveries: Sequence[Recovery],
    progress: Sequence[tuple[float, int]],
) -> Goodput:
    """`progress`: (when, newest step) samples, in time order."""
    end = max(end, start)
    spans: list[tuple[float, float, str]] = []
    first_step = next((at for at, _ in progress), None)
    if first_step is not None:  # a job that reports no steps: its start-up cannot be told
        spans.append((start, first_step, "startup"))
    for r in recoveries:
        happened = min(r.fault_at, r.detected_at)
        spans.append((happened, r.detected_at, "slow" if r.slow else "detection"))
        if r.resumed_at is None:
            spans.append((r.detected_at, end, "unrecovered"))
            continue
        spans.append((r.detected_at, r.resumed_at, "recovery"))
        reached = max((step for at, step in progress if at <= happened), default=None)
        if reached is not None:
            caught_up = next(
                (at for at, step in progress if at >= r.resumed_at and step > reached), end
            )
            spans.append((r.resumed_at, caught_up, "recomputed"))
    lost = _sweep(spans, start, end)
    wall = end - start
    return Goodput(wall, wall - sum(lost.values()), lost)


def _sweep(spans: list[tuple[float, float, str]], start: float, end: float) -> dict[str, float]:
    """Seconds of [start, end] covered by each cause, an instant counted once, for the first
    cause (in CAUSES order) that covers it."""
    clipped = [(max(a, start), min(b, end), c) for a, b, c in spans if min(b, end) > max(a, start)]
    cuts = sorted({start, end, *(a for a, _, _ in clipped), *(b for _, b, _ in clipped)})
    lost = dict.fromkeys(CAUSES, 0.0)
    rank = {cause: i for i, cause in enumerate(CAUSES)}
    for lo, hi in itertools.pairwise(cuts):
        covering = [c for a, b, c in clipped if a <= lo and b >= hi]
        if covering:
            lost[min(covering, key=rank.__getitem__)] += hi - lo
    return lost
