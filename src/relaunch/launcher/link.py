"""A launcher's link to its controller: the connection, what waits for the next controller while
none is connected, and when the pod counts as abandoned.

The link connects to the controller whose address the state directory holds and, when that
controller goes away, to whichever writes its address next: a controller restart loses no pod.
While no controller is connected, exits, stops, progress and restores are kept and sent to the
next one.
The pod is **abandoned** after `adopt_grace_s` without a controller, or, with a connection that
stays open while nothing comes over it (a node cut off from the controller but running), once
the plan's `lease_s` passes without a word (the controller renews it every quarter lease, R-14).
An abandoned pod never reconnects: it is ending, and a controller that adopted it would hear its
processes stop without a fault.

    link = ControllerLink(state_dir, plan, hello=..., received=..., wake=...)
    threading.Thread(target=link.serve, daemon=True).start()
    link.send(message)               # or kept while no controller is connected
    link.abandoned()                 # the launcher's loop asks at every turn
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from relaunch.protocol.messages import (
    Exited,
    LauncherHello,
    Lease,
    Message,
    ProgressBatch,
    Restored,
    Stopped,
)
from relaunch.protocol.plans import LaunchPlan
from relaunch.protocol.wire import Connection, controller_address

__all__ = ["KEPT_WHILE_AWAY", "ControllerLink"]

KEPT_WHILE_AWAY = (Exited, Stopped, ProgressBatch, Restored)
"""Messages kept for the next controller while none is connected: what decides a fault or ends a
recovery, and what the job's record holds (which tier served a restore: a rank replaced just
before the controller was killed restores while it is away). Not a collective's failure: the
ranks waited for an order only as long as the job's retry settings, and a group they have
formed anew since must not be re-formed for it."""
RECONNECT_S = 0.1


class ControllerLink:
    def __init__(
        self,
        state_dir: Path,
        plan: LaunchPlan,
        hello: Callable[[], LauncherHello],
        received: Callable[[Message], None],
        wake: Callable[[], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = state_dir
        self.plan = plan
        """The launcher's plan (a standby launcher's changes when it becomes a pod's)."""
        self.hello = hello
        """What the launcher says when it connects (its processes as they are now)."""
        self.received = received
        """Each command from the controller (leases are the link's own)."""
        self.wake = wake
        """Wakes the launcher's loop: an abandonment's deadline moved."""
        self.clock = clock
        self.lock = threading.Lock()
        self.conn: Connection | None = None
        self.outbox: list[Message] = []
        now = clock()
        self.alone_since: float | None = now
        """Since when no controller is connected (None: one is)."""
        self.heard_at = now
        """When the controller last said anything (a `Lease` at least every quarter lease)."""
        self.abandoned_at: float | None = None
        self.fenced = False
        """Abandoned because the lease ran out with the connection still open (R-14)."""

    def send(self, message: Message, *, urgent: bool | None = None) -> None:
        """To the controller, or kept for the next one (KEPT_WHILE_AWAY) while none is there."""
        with self.lock:
            conn = self.conn
            undelivered = conn is None or not conn.send(message, urgent=urgent)
            if undelivered and isinstance(message, KEPT_WHILE_AWAY):
                self.outbox.append(message)

    def serve(self) -> None:
        """Connected to the controller whose address the state directory holds; reconnects to
        the next one, until the pod is abandoned."""
        while self.abandoned_at is None:
            address = controller_address(self.state_dir)
            conn = None
            if address is not None:
                try:
                    conn = Connection.connect(*address)
                except OSError:
                    conn = None
            if conn is not None and conn.send(self.hello()):
                self._converse(conn)
            time.sleep(RECONNECT_S)

    def _converse(self, conn: Connection) -> None:
        """One controller's connection: the backlog first, then its commands until it closes."""
        with self.lock:
            self.conn = conn
            backlog, self.outbox = self.outbox, []
            self.alone_since = None
            self.heard_at = self.clock()
        for message in backlog:
            conn.send(message)
        for message in conn:
            self.heard_at = self.clock()
            if not isinstance(message, Lease):
                self.received(message)
        with self.lock:
            self.conn = None
            self.alone_since = self.clock()
        self.wake()  # the adopt grace runs from now

    def due(self) -> float | None:
        """When the pod would be abandoned if nothing is heard before (None: never)."""
        with self.lock:
            if self.alone_since is not None:
                return self.alone_since + self.plan.adopt_grace_s
            if self.plan.lease_s is not None:
                return self.heard_at + self.plan.lease_s
        return None

    def abandoned(self) -> bool:
        """No controller for `adopt_grace_s`, or no word from a connected one for the lease
        (said once, on the pod's log)."""
        now = self.clock()
        with self.lock:
            alone, heard = self.alone_since, self.heard_at
        lease = self.plan.lease_s
        closed = alone is not None and now - alone > self.plan.adopt_grace_s
        silent = alone is None and lease is not None and now - heard > lease
        if not (closed or silent):
            return self.abandoned_at is not None
        if self.abandoned_at is None:
            self.abandoned_at = now
            self.fenced = silent
            if silent:
                print(
                    f"[relaunch] no word from the controller for {now - heard:.1f} s (lease "
                    f"{lease:g} s, R-14): this pod stops its processes",
                    flush=True,
                )
        return True

    def kill_by(self) -> float:
        """The latest moment a process of this pod may still run: once abandoned, at most
        `adopt_grace_s` (the lease, when it ran out) and the job's grace after that."""
        if not self.abandoned() or self.abandoned_at is None:
            return float("inf")
        return self.abandoned_at + self.abandon_grace()

    def abandon_grace(self) -> float:
        """How long an abandoned pod's processes have between SIGTERM and SIGKILL."""
        plan = self.plan
        bound = plan.lease_s if self.fenced and plan.lease_s else plan.adopt_grace_s
        return min(plan.termination_grace_s, bound)
