"""The controller: the one loop that turns observations into faults, faults into decisions, and
decisions into actions, and writes down everything it does.

    step:  drain messages ──> detect (exits, heartbeats, launchers, hangs, chips) ──> decide
           (recovery.RecoveryDriver) ──> act (actions.*: desired state + commands) ──> reconcile
           (reconcile.Reconciler: the running pods converge to the desired state)

Level-triggered, as a Kubernetes controller: the store holds the desired state (every pod's node,
generation and counters; the job's attempt); each pass compares what agents and launchers report
with it and converges. Never blocks: every wait (a heal, a teardown, an adoption) is a deadline
checked by a later pass. Time comes from an injected clock, messages from an inbox, processes
from an engine, so that the loop runs the same under unit tests with fakes as in production.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from relaunch.cluster import Engine
from relaunch.cluster.config import ClusterConfig
from relaunch.controller import checks, detectors, lifecycle
from relaunch.controller.clock import TICK_S, Clock, SystemClock
from relaunch.controller.context import RunOptions, TrainingProgress
from relaunch.controller.dispatch import dispatch
from relaunch.controller.faultplan import FaultPlanRunner
from relaunch.controller.fencing import LeaseKeeper
from relaunch.controller.listener import Listener
from relaunch.controller.membership import MembershipPublisher
from relaunch.controller.pacer import IDLE_PASS_S, READ_EVERY_S, Adoption, Pacer
from relaunch.controller.peers import AgentLink, LauncherLink, Peer
from relaunch.controller.pods import Pod, PodPhase
from relaunch.controller.reconcile import Reconciler
from relaunch.controller.recovery import RecoveryDriver
from relaunch.events import Event, EventKind
from relaunch.faults.plan import PlannedFault
from relaunch.protocol.layout import StateDir
from relaunch.protocol.messages import Message
from relaunch.spec import JobSpec
from relaunch.states import StopCause
from relaunch.store import JobRow, JobStatus, NodeRow, NodeState, PodRow, Store

__all__ = ["IDLE_PASS_S", "TICK_S", "Controller", "RunOptions"]

DRAIN_ROUNDS: Final = 20
"""Reads of every ready connection per step at most, before the checks run anyway."""
DUE_MARGIN_S: Final = 0.001
"""A deadline's pass runs this much after it (the detectors count silence strictly longer)."""
HEARTBEAT_WRITTEN_EVERY_S: Final = 5.0
"""How often the nodes' last heartbeats are written to the store (the record's "last
heartbeat"), all in one transaction (or every heartbeat interval, when that is longer)."""
SEEN_EVERY_S: Final = 0.5
"""How often the controller writes that it is alive (a resume tells how long it was away)."""


def print_event(event: Event) -> None:
    """The default `on_event`: the event's sentence on standard output."""
    print(event.text)


class Controller:
    listener: Listener | None
    """The socket agents and launchers connect to, while the controller runs."""
    caught_up_at: float
    """When the controller last had read everything its peers had sent: silence is measured up
    to then, so that a controller that fell behind (a stall, a start of hundreds of processes on
    few cores) never takes its own lateness for a silent node."""
    links: dict[int, LauncherLink]
    """Each connected launcher's link, by its peer's identity (`linked`)."""
    capture: detectors.StackCaptures
    """A hang's stacks being captured before it is decided (controller.stacks)."""
    hang_watch: detectors.HangWatch
    """When the hang detector looks at the ranks again (checks.hangs)."""
    slow: detectors.SlowWatch
    """When the slow-pod check compared the pods, and which looked slow since when (checks.slow)."""

    def __init__(
        self,
        store: Store,
        engine: Engine,
        state_dir: Path,
        cluster: ClusterConfig,
        job_id: int,
        spec: JobSpec,
        plan: tuple[PlannedFault, ...],
        options: RunOptions,
        on_event: Callable[[Event], None] = print_event,
        on_output: Callable[[int, int, str], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.layout = StateDir(state_dir)
        self.cluster = cluster
        self.job_id = job_id
        self.spec = spec
        self.recovery = spec.recovery
        self.options = options
        self.clock: Clock = clock or SystemClock()
        self.hang_s = spec.recovery.hang_detect_s
        self.startup_s = options.startup_s or spec.recovery.startup_s
        self.on_event = on_event
        self.on_output = on_output
        self.on_tick = on_tick
        self.inbox: queue.Queue[tuple[Peer, Message | None]] = queue.Queue()
        self.listener = None
        self.caught_up_at = self.clock.now()
        self.job: JobRow = store.job(job_id)
        self.ended_copies = lifecycle.ended_jobs_copies(store.jobs(), job_id)
        self.nodes: dict[str, NodeRow] = {}
        self.refresh_nodes()
        self.pods: dict[int, Pod] = {p.idx: Pod(p) for p in store.pods(job_id)}
        self.agents: dict[str, AgentLink] = {}
        self.links = {}
        self.progress = TrainingProgress(self.job.last_step, self.job.last_step is not None)
        self.adoption = Adoption()
        self.pacer = Pacer.for_pods(len(self.pods))
        self.seen_written = 0.0
        self.heartbeats_written = 0.0
        self.capture = detectors.StackCaptures()
        self.hang_watch = detectors.HangWatch()
        self.slow = detectors.SlowWatch()
        self.recoveries = RecoveryDriver(self)
        self.membership = MembershipPublisher(self)
        self.fault_plan = FaultPlanRunner(self, plan)
        self.reconciler = Reconciler(self)
        self.leases = LeaseKeeper(self)

    # -- the loop -------------------------------------------------------------------------------

    def receive(self, peer: Peer, message: Message | None) -> None:
        """A message from a peer (None: its connection closed), handled by the next step; for
        peers that are not the listener's (unit tests). Call it from the controller's thread:
        a wait on the listener does not wake for it."""
        self.inbox.put((peer, message))

    def hurry(self) -> None:
        """Act on what just happened now, not at the next scheduled pass."""
        self.pacer.hurry()

    def step(self, wait: float = 0.0) -> None:
        """Handle what arrived (waiting up to `wait` for the first message), then one pass of
        checks when it is due: a tick after the last while something is under way; while the
        job trains undisturbed, at its next deadline (or when a message hurries it)."""
        self.drain(wait)
        now = self.clock.now()
        if self.pacer.steady_since is not None and self._engine_lost_one():
            self.hurry()
        if not self.pacer.due(now):
            return
        self.pass_(now)
        self.pacer.passed(now, self.steady(now), self.next_due)

    def steady(self, now: float) -> bool:
        """The job trains undisturbed: nothing a pass drives is under way (no start, stop,
        recovery, decision, heal, stack capture, adoption, scale-out, planned fault or standby
        launcher to come), every pod's launcher runs the current attempt. Then nothing changes
        between messages but the passing of the deadlines `next_due` gives."""
        job = self.job
        adoption = self.adoption
        if job.status is not JobStatus.RUNNING or adoption.resuming or now < adoption.until:
            return False
        recoveries = self.recoveries
        if recoveries.active is not None or recoveries.waiting or self.capture.busy:
            return False
        if self.membership.joining or self.membership.parked() or not self.fault_plan.finished:
            return False
        if not self.reconciler.standby_settled():
            return False
        return all(
            pod.phase is PodPhase.RUNNING
            and pod.leaving is None
            and pod.link is not None
            and not pod.link.stopping
            and pod.link.started_attempt == job.attempt
            for pod in self.pods.values()
        )

    def next_due(self, now: float) -> float:
        """When a pass must look again if no message asks first: the first node that could be
        silent for the heartbeat timeout, the first rank that could be silent for its hang
        window, the next comparison of busy shares. Messages only move the first two later."""
        due = [now + IDLE_PASS_S]
        silence = detectors.heartbeat_due(
            self.nodes.values(), self.agents, self.cluster.heartbeat_timeout_s, now
        )
        watch = self.hang_watch  # looked at this pass (see checks.hangs)
        hang = watch.due if watch.fresh else now
        due += [at + DUE_MARGIN_S for at in (silence, hang) if at is not None]
        due.append(self.leases.next_renewal())
        if self.cluster.slow_window_s > 0:
            due.append(self.slow.checked_at + checks.SLOW_CHECKED_EVERY_S)
        return min(due)

    def _engine_lost_one(self) -> bool:
        """The engine reports a node of the job dead that the controller does not know lost."""
        gone = self.engine.lost_nodes()
        return bool(gone) and any(
            (row := self.nodes.get(name)) is not None and row.state is not NodeState.LOST
            for name in gone
        )

    def run(self) -> tuple[JobStatus, str]:
        """Run (or resume) the job until it ends; its status and why."""
        return lifecycle.run(self)

    def stop(self, reason: str, cause: StopCause) -> None:
        """Stop the job at the user's request (Ctrl-C, SIGTERM, a hangup)."""
        lifecycle.stop(self, reason, cause)

    def drain(self, wait: float) -> None:
        """Handle every message that arrived, waiting up to `wait` for the first: from the
        listener's connections (production) and from the inbox (what `receive` was given).
        Reads again until nothing more is waiting (DRAIN_ROUNDS at most, so that the checks
        still run under a flood); once nothing is, `caught_up_at` says the controller has
        heard everything sent before then."""
        caught_up = True
        if self.listener is not None:
            if self.pacer.steady_since is not None and self.listener.rings and self.inbox.empty():
                # Undisturbed: read when the next pass is due, or at once for a doorbell, a
                # new connection or a closed one; routine messages wait on their sockets.
                woken = self.listener.wait_quietly(wait)
                received = self.listener.poll(0.0)
                if woken and not received:  # a bell may overtake its message between hosts
                    received = self.listener.poll(READ_EVERY_S)
            else:
                since = self.clock.monotonic() - self.pacer.read_at
                gap = self.pacer.read_gap()
                if since < gap:  # gather what arrives meanwhile into one read
                    self.clock.sleep(gap - since)
                    wait = max(0.0, wait - (gap - since))
                received = self.listener.poll(wait if self.inbox.empty() else 0.0)
            self.pacer.read_at = self.clock.monotonic()
            rounds = 0
            while received:
                for conn, message in received:
                    dispatch(self, conn, message)
                rounds += 1
                if rounds == DRAIN_ROUNDS:
                    caught_up = False
                    break
                received = self.listener.poll(0.0)
            wait = 0.0
        try:
            peer, message = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
        except queue.Empty:
            peer = None
        while peer is not None:
            dispatch(self, peer, message)
            try:
                peer, message = self.inbox.get_nowait()
            except queue.Empty:
                peer = None
        if caught_up:
            self.caught_up_at = self.clock.now()

    def pass_(self, now: float) -> None:
        """One round of the level-triggered checks, in the flow's order."""
        if self.store.changed_elsewhere():  # the API asked for a stop, added faults, cordoned
            self.job = self.store.job(self.job_id)
            self.refresh_nodes()
        if now - self.seen_written >= SEEN_EVERY_S:
            self.seen_written = now
            self.update_job(controller_seen_at=now)
        if now - self.heartbeats_written >= max(
            HEARTBEAT_WRITTEN_EVERY_S, self.cluster.heartbeat_interval_s
        ):
            self.heartbeats_written = now
            self.store.set_heartbeats({n: a.last_heartbeat for n, a in self.agents.items()})
        checks.adoption(self, now)
        checks.requests(self, now)
        # detect
        self.recoveries.check(now)
        checks.heartbeats(self, now)
        checks.launchers(self, now)
        checks.hangs(self, now)
        checks.slow(self, now)
        # decide (every fault detected so far, here or while draining messages)
        self.recoveries.decide_waiting(now)
        # act
        self.fault_plan.fire(now)
        self.membership.scale_out(now)
        self.reconciler.converge(now)
        self.reconciler.keep_standby(now)
        self.leases.renew(now)
        checks.done(self, now)
        if self.on_tick is not None:
            self.on_tick()

    # -- the state the parts share ------------------------------------------------------------------

    def event(self, kind: EventKind, **fields: Any) -> None:
        """Records an event of `kind` (its fields as `Event.of` takes them) and tells `on_event`."""
        event = Event.of(kind, **fields)
        self.store.event(self.job_id, event, self.clock.now())
        self.on_event(event)

    def update_job(self, **fields: object) -> None:
        """Writes the job's fields and keeps its row in memory the same, without reading it back
        (the row's spec and fault plan are JSON: read whole, milliseconds at thousands of pods,
        for a write of one field)."""
        self.store.update_job(self.job_id, **fields)
        self.job = replace(self.job, **fields)  # type: ignore[arg-type]

    def move_job(
        self, to: JobStatus, *, reason: str = "", cause: StopCause | None = None, **fields: object
    ) -> None:
        """Moves the job's status (the store's `move_job`: the status machine's one writer) and
        writes `fields` with it, keeping the row in memory the same."""
        now = self.clock.now()
        with self.store.transaction():
            moved = self.store.move_job(
                self.job_id, self.job.status, to, now, reason=reason, cause=cause
            )
            if moved is None:  # another writer came first: the store's row is the truth
                self.job = self.store.job(self.job_id)
                return
            self.store.update_job(self.job_id, **fields)
        self.job = replace(self.job, **moved, **fields)  # type: ignore[arg-type]

    def put_pod(self, row: PodRow) -> None:
        self.put_pods([row])

    def put_pods(self, rows: list[PodRow]) -> None:
        self.store.put_pods(rows)
        for row in rows:
            pod = self.pods.get(row.idx)
            if pod is None:
                self.pods[row.idx] = Pod(row)
            else:
                pod.row = row

    def refresh_nodes(self) -> None:
        self.nodes = {n.name: n for n in self.store.nodes()}

    def refresh_node(self, name: str) -> None:
        """One node's row read again (its state changed): not every node's, of thousands."""
        row = self.store.node(name)
        if row is not None:
            self.nodes[name] = row

    def node(self, name: str) -> NodeRow | None:
        return self.nodes.get(name)

    def ranks_of(self, pod: int) -> tuple[int, ...]:
        first = pod * self.spec.procs_per_pod
        return tuple(range(first, first + self.spec.procs_per_pod))

    def launcher_of(self, peer: Peer, leaving: bool = False) -> LauncherLink | None:
        """The pod launcher on `peer`; `leaving`: the one a pod is tearing down."""
        link = self.links.get(id(peer))
        pod = self.pods.get(link.pod) if link is not None else None
        if pod is None or (pod.leaving if leaving else pod.link) is not link:
            return None
        return link

    def linked(self, link: LauncherLink) -> None:
        """`link` is what its peer's messages are about from now on (a hello, a standby
        launcher that became a pod's): found by `launcher_of` without a look at every pod."""
        self.links[id(link.peer)] = link
