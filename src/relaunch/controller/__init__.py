"""The controller: the one loop that turns observations into faults, faults into decisions and
decisions into actions (see controller.core for the loop, and each module for its part:
detectors, recovery, actions, reconcile, fault plan, membership, lifecycle)."""

from relaunch.controller.clock import Clock, SystemClock
from relaunch.controller.core import Controller, RunOptions

__all__ = ["Clock", "Controller", "RunOptions", "SystemClock"]
