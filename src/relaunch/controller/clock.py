"""The controller's clock, a port: the system clock in production, a fake one in unit tests."""

from __future__ import annotations

import time
from typing import Final, Protocol

__all__ = ["TICK_S", "Clock", "SystemClock"]

TICK_S: Final = 0.05
"""How often the controller's checks run (heartbeats, hangs, fault plan, reconcile)."""


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (the same clock the agents and launchers stamp with)."""
        ...

    def monotonic(self) -> float:
        """Seconds that only go forward (for gaps between reads, never stored)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait (a fake clock moves on instead)."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
