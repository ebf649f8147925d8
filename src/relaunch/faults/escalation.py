"""Time rules over a fault history: escalation (R-10), short network blips (R-12), the same code on
several chips at once (R-13), and when an isolated node may be released.

Time is always an argument (`Fault.at`, `now`); nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from relaunch.faults.kinds import Fault, FaultKind

__all__ = [
    "EscalationRules",
    "counts_for_escalation",
    "escalates",
    "is_network_blip",
    "release_due",
    "same_code_elsewhere",
]


@dataclass(frozen=True)
class EscalationRules:
    """Windows and thresholds; the defaults are the seeds' numbers."""

    window_s: float = 24 * 3600.0
    """R-10: the same code `threshold` times in a row within this window isolates the node."""
    threshold: int = 3
    release_after_s: float = 48 * 3600.0
    """R-10: an isolated node is released after this long without a fault."""
    network_blip_s: float = 20.0
    """R-12: a link fault lasting at most this long is recorded, not handled."""
    multi_chip_window_s: float = 30.0
    """R-13: the same code on several chips within this window is a software fault."""
    process_fault_max_age_s: float = 60.0
    """R-31: recover-in-place only handles faults at most this old."""

    def __post_init__(self) -> None:
        if not 60 <= self.window_s <= 864000:
            raise ValueError(f"escalation window {self.window_s:g} s is outside 60..864000 s")
        if not 1 <= self.threshold <= 100:
            raise ValueError(f"escalation threshold {self.threshold} is outside 1..100")
        if self.release_after_s <= 0:
            raise ValueError("release_after_s must be positive")


def is_network_blip(fault: Fault, rules: EscalationRules) -> bool:
    """R-12. A link fault with no known duration is still down, so it is not a blip."""
    return (
        fault.kind is FaultKind.NETWORK
        and fault.duration_s is not None
        and fault.duration_s <= rules.network_blip_s
    )


def same_code_elsewhere(fault: Fault, others: Sequence[Fault], rules: EscalationRules) -> bool:
    """R-13: another chip reported the same code within the window (before or after `fault`)."""
    if fault.kind is not FaultKind.CHIP:
        return False
    return any(
        other.kind is FaultKind.CHIP
        and other.code == fault.code
        and other.chip_key != fault.chip_key
        and abs(other.at - fault.at) <= rules.multi_chip_window_s
        for other in others
    )


def counts_for_escalation(fault: Fault, others: Sequence[Fault], rules: EscalationRules) -> bool:
    """A chip fault counts towards R-10 unless R-13 made it a software fault."""
    return fault.kind is FaultKind.CHIP and not same_code_elsewhere(fault, others, rules)


def escalates(fault: Fault, earlier: Sequence[Fault], rules: EscalationRules) -> bool:
    """R-10: this fault is the `threshold`-th in a row with the same code on the same chip of the
    same node, all within the window. Faults R-13 discounts are left out of the row."""
    everything = [*earlier, fault]
    if not counts_for_escalation(fault, everything, rules):
        return False
    row = [
        f
        for f in earlier
        if f.chip_key == fault.chip_key
        and f.at <= fault.at
        and counts_for_escalation(f, everything, rules)
    ]
    row.sort(key=lambda f: f.at)
    needed = rules.threshold - 1
    if needed == 0:
        return True
    if len(row) < needed:
        return False
    last = row[-needed:]
    return all(f.code == fault.code for f in last) and fault.at - last[0].at <= rules.window_s


def release_due(
    isolated_at: float, last_fault_at: float | None, now: float, rules: EscalationRules
) -> bool:
    """An isolated node goes back to Ready after `release_after_s` without a fault (R-10)."""
    quiet_since = max(isolated_at, last_fault_at or isolated_at)
    return now - quiet_since >= rules.release_after_s
