"""Convergence: the running pods brought to their desired state, level-triggered, every pass.

Compares every pod's launcher with its row (node, generation) and the job's attempt, and does the
next thing: retires launchers of older generations, asks the engine for missing launchers (or
turns a standby launcher into one), stops processes of older attempts, and starts the current
attempt once nothing is still stopping, on each pod as soon as its launcher is connected (a pod
whose new launcher is on its way runs nothing; a pod still waiting to be launched, for its old
container's teardown, a lost node or R-14's fence, holds every start back). Keeps one standby
launcher per schedulable node when warm spares are on, and the checkpoint fence up to date. A
restarted controller or a repeated message is harmless: each pass only looks at what is and
what should be.
"""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING

from relaunch import failpoints
from relaunch.controller import commands
from relaunch.controller.actions import action_for
from relaunch.controller.peers import LauncherLink
from relaunch.controller.pods import LAUNCH_RETRY_S, Pod, PodPhase
from relaunch.events import EventKind
from relaunch.protocol.messages import Assume, MembershipUpdate, Shutdown, Start, Stop
from relaunch.protocol.plans import LaunchPlan, write_atomically
from relaunch.store import NodeState

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext

__all__ = ["ASSUMED_SAID_EACH", "Reconciler"]

ASSUMED_SAID_EACH = 16
"""Up to this many pods taking standby launchers in one pass are said a line each."""


class Reconciler:
    def __init__(self, controller: ControllerContext) -> None:
        self.c = controller
        self.standby: dict[str, LauncherLink] = {}
        """Launchers keeping warm spares (spec.warm_spares) for the next pod placed on their
        node, by node."""
        self.standby_launching: dict[str, float] = {}
        self.placed: dict[int, tuple[int, str]] = {}
        """Pod -> (generation, node) last seen, to tell a move off a lost node."""
        self.fenced: dict[int, int] = {}
        """Pod -> the oldest generation allowed to write checkpoints."""
        self.fence_written: dict[str, dict[str, int]] = {}
        self.startable = 0
        """The attempt the last pass found may start: a pod that connects is started at once."""
        self.partial = 0
        """The attempt some pods were started for while others' new launchers were on their way."""
        self.everywhere: tuple[int, float] = (0, 0.0)
        """(attempt, when its last pod got its start), for the `partial` attempt."""
        self.fence_said: int | None = None
        """The record whose wait for a silent node's lease was said (once each)."""
        self.taken_out_told: set[str] = set()
        """Nodes this controller told the engine it took out (Slurm drains them)."""
        try:  # a restarted controller keeps the fence
            written = json.loads(self.c.layout.job(self.c.job_id).fence.read_text())
            self.fenced = {int(k): int(v) for k, v in written["generations"].items()}
            self.fence_written = {"generations": {str(k): v for k, v in self.fenced.items()}}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no fence yet

    def converge(self, now: float) -> None:
        c = self.c
        self.startable = 0  # until this pass finds the attempt may start
        self._tell_taken_out()
        if c.job.status.ended or now < c.adoption.until:
            return
        self._write_fence()
        shutdown = Shutdown(commands.stop_grace(c))  # one message for all, encoded once
        retired = sum(self._retire(pod, shutdown, now) for pod in c.pods.values())
        if retired:
            commands.said_stopping(c, retired, "their containers are rebuilt")
        parked = c.membership.parked()
        pods = [p for p in c.pods.values() if p.index not in parked]
        assumed: list[tuple[int, str]] = []
        connected = [pod for pod in pods if self._connect(pod, now, assumed)]
        self._said_assumed(assumed)
        if len(connected) == len(pods):
            self._stop_or_start(connected)
            self._started_everywhere(connected, now)
        elif all(pod.connected or pod.phase is PodPhase.LAUNCHING for pod in pods) and (
            # a pod whose new launcher is on its way runs nothing (its old container is gone,
            # and past R-14's fence): the others need not wait for it to start
            self._stop_or_start(connected)
        ):
            self.partial = c.job.attempt

    def started_everywhere(self, attempt: int) -> float | None:
        """When the attempt's last pod got its start, where some pods started before the rest
        had their launchers (their ranks wait for the rest in their rendezvous: not hung, R-25);
        None while one has not; 0.0 when no pod started early."""
        if self.partial != attempt:
            return 0.0
        if self.everywhere[0] == attempt:
            return self.everywhere[1]
        return None

    def _started_everywhere(self, pods: list[Pod], now: float) -> None:
        attempt = self.c.job.attempt
        if self.partial != attempt or self.everywhere[0] == attempt:
            return
        if all(p.link is not None and p.link.started_attempt >= attempt for p in pods):
            self.everywhere = (attempt, now)

    def _tell_taken_out(self) -> None:
        """A node of the cluster isolated or lost since the last pass is told to the engine,
        outside the record's transaction that isolated it (Slurm drains it, so that a requeued
        job is not given it again); where it could not be, said once."""
        c = self.c
        for spec in c.cluster.nodes:
            row = c.nodes.get(spec.name)
            if row is None or spec.name in self.taken_out_told:
                continue
            if row.state not in (NodeState.ISOLATED, NodeState.LOST):
                continue
            self.taken_out_told.add(spec.name)
            said = row.reason
            if not said.startswith(("lost", "isolated")):
                said = f"{row.state.value.lower()}: {said}"
            why = c.engine.isolate_node(spec.name, said)
            if why is not None:
                c.event(EventKind.ISOLATED_BY_RELAUNCH_ONLY, node=spec.name, why=why)

    def _retire(self, pod: Pod, shutdown: Shutdown, now: float) -> int:
        """A launcher of an older generation is told to shut down; 1 if one was."""
        link = pod.link
        if link is None or link.generation == pod.row.generation:
            return 0
        link.peer.send(shutdown)
        old = self.c.node(link.node)
        # a lost node's pods are not waited for: it may never answer (hung or cut off); they
        # are fenced instead, and get this shutdown if it comes back
        pod.retire(now, wait=old is None or old.state is not NodeState.LOST)
        return 1

    def _connect(self, pod: Pod, now: float, assumed: list[tuple[int, str]]) -> bool:
        """True if the pod has its launcher; otherwise asks for one when it can (a standby
        launcher it takes is noted in `assumed`: (pod, node))."""
        c = self.c
        if pod.connected:
            return True
        if pod.phase is PodPhase.LOST:
            return False  # waiting for it to come back, or for the fault it becomes
        limit = c.recovery.volume_teardown_grace_s
        if limit is None:
            limit = c.recovery.termination_grace_s + 10.0  # never wait forever for a dead peer
        if pod.teardown_pending(now, limit):
            return False
        node = c.node(pod.row.node)
        if node is None or node.state is NodeState.LOST or pod.row.node not in c.agents:
            return False
        if self._fenced(now):
            return False
        standby = self.standby.pop(pod.row.node, None)
        if standby is not None and not standby.peer.closed:
            self._assume(standby, pod, now)
            assumed.append((pod.index, pod.row.node))
            return True
        if pod.needs_launch(now):
            pod.launching(now)
            try:
                c.engine.start_pod(commands.launch_plan(c, pod.row))
            except (OSError, subprocess.SubprocessError) as error:
                # what the engine could not do is an observation: the pod is started again
                # once its launch is overdue (PodPhase.LAUNCHING), the controller carries on
                c.event(
                    EventKind.LAUNCHER_FAILED, pod=pod.index, node=pod.row.node, error=str(error)
                )
        return False

    def _fenced(self, now: float) -> bool:
        """R-14: the recovery under way replaces a silent node's pods, which may still run until
        their lease and grace are over: no new launcher starts before (said once)."""
        c = self.c
        until = c.leases.hold_until()
        if until is None or now >= until:
            return False
        active = c.recoveries.active
        if active is not None and self.fence_said != active.record_id:
            self.fence_said = active.record_id
            c.event(
                EventKind.FENCE_WAIT,
                node=active.fault.node,
                wait_s=until - now,
                lease_s=c.cluster.lease_s,
            )
        return True

    def _stop_or_start(self, pods: list[Pod]) -> bool:
        """Stops the pods' processes of older attempts, or starts the current attempt on the
        pods that have not started it once none is stopping; True if one was started."""
        c = self.c
        attempt = c.job.attempt
        links = [p.link for p in pods if p.link is not None]
        old = [p for p in pods if p.link is not None and p.link.running_older_than(attempt)]
        if old:
            stopping = [p for p in old if p.phase is not PodPhase.STOPPING]
            stop = Stop(commands.stop_grace(c))  # one message for all, encoded once
            for pod in stopping:
                assert pod.link is not None
                pod.link.peer.send(stop)
                pod.stop_sent(c.clock.now())
            if stopping:
                commands.said_stopping(c, len(stopping), "their containers stay")
            return False
        if any(link.stopping for link in links):
            return False
        active = c.recoveries.active
        if active is not None and not action_for(active.action).ready_to_start(active):
            return False  # in-place waits for its heal
        self.startable = attempt
        started = False
        for pod in pods:
            link = pod.link
            assert link is not None
            if link.started_attempt < attempt:
                started = True
                self._start(link, pod, attempt)
        if started and attempt > 1:
            failpoints.reach("starting")
        return started

    def _start(self, link: LauncherLink, pod: Pod, attempt: int) -> None:
        link.started_attempt = attempt
        link.peer.send(Start(attempt, commands.pod_environment(self.c, pod.row, attempt)))

    def connected(self, pod: Pod) -> None:
        """A pod's launcher said hello: started at once if the last pass found the attempt
        may start (nothing stopping, every other pod connected or its launcher on its way),
        rather than at the next pass: each pass looks at every pod, and the launchers of a
        rebuilt job of thousands of pods arrive over a second or more."""
        attempt = self.c.job.attempt
        link = pod.link
        if (
            self.startable != attempt
            or link is None
            or link.stopping
            or link.started_attempt >= attempt
            or link.running_older_than(attempt)
        ):
            return
        self.partial = attempt  # others may not have started: the hang window waits for them
        self._start(link, pod, attempt)
        if attempt > 1:
            failpoints.reach("starting")

    def _assume(self, standby: LauncherLink, pod: Pod, now: float) -> None:
        """The standby launcher on the pod's new node becomes its launcher: its warm spares
        become the pod's processes at the next start."""
        c = self.c
        plan = commands.launch_plan(c, pod.row)
        standby.peer.send(Assume(plan))
        c.engine.assumed(c.job_id, pod.row.node, pod.index, pod.row.generation)
        link = LauncherLink(
            standby.peer, pod.index, pod.row.generation, standby.pid, node=pod.row.node
        )
        c.linked(link)
        pod.connect(link, now)
        current = c.membership.current()
        if c.recovery.process_level and current is not None:
            link.peer.send(MembershipUpdate(current))

    def _said_assumed(self, assumed: list[tuple[int, str]]) -> None:
        """The pods that took their node's standby launcher in a pass: a line each for a few,
        one line for many (a job-level restart of thousands of pods wrote thousands of lines,
        a sixth of its controller's time)."""
        if len(assumed) > ASSUMED_SAID_EACH:
            (first, node), (last, _) = assumed[0], assumed[-1]
            self.c.event(
                EventKind.STANDBYS_TAKEN, count=len(assumed), first=first, node=node, last=last
            )
            return
        for pod, node in assumed:
            self.c.event(EventKind.STANDBY_TAKEN, pod=pod, node=node)

    # -- standby launchers ----------------------------------------------------------------------

    def standby_nodes(self) -> set[str]:
        """Nodes that keep a standby launcher: with warm spares, every schedulable node with a
        live agent and the chips for a pod, whether a pod of the job runs there or not. A pod
        rebuilt on its node (job-level rescheduling) or moved to a standby node takes the
        node's standby launcher, whose spares become its processes."""
        return {node for node in self.c.nodes if self._keeps_standby(node)}

    def _keeps_standby(self, node: str) -> bool:
        """Whether `node` keeps a standby launcher (a free node's conditions: schedulable, the
        chips for a pod, a live agent), looked at alone: a standby launcher's hello asked for
        the whole set, and thousands of them arriving made a job's start quadratic in its
        nodes (a simulated job of 4,096 pods took a minute to hear its standby launchers)."""
        c = self.c
        row = c.node(node)
        return (
            bool(c.spec.warm_spares)
            and row is not None
            and row.schedulable
            and row.chips >= c.spec.chips_per_pod
            and node in c.agents
        )

    def standby_settled(self) -> bool:
        """Every node that keeps a standby launcher has one (none is to be started)."""
        return self.standby_nodes() <= set(self.standby)

    def awaiting_launcher(self) -> set[str]:
        """Nodes where a pod was placed and has no launcher yet (a standby one may become it)."""
        parked = self.c.membership.parked()
        return {
            p.row.node for p in self.c.pods.values() if not p.connected and p.index not in parked
        }

    def keep_standby(self, now: float) -> None:
        """Level-triggered like the pods: one standby launcher per standby node, none elsewhere."""
        c = self.c
        if c.job.status.ended or now < c.adoption.until:
            return
        wanted = self.standby_nodes()
        for node, link in list(self.standby.items()):
            if node not in wanted and node not in self.awaiting_launcher():
                link.peer.send(Shutdown(0.0))
                del self.standby[node]
        if not self._settled():
            return
        for node in sorted(wanted - set(self.standby)):
            since = self.standby_launching.get(node)
            if since is not None and now - since < LAUNCH_RETRY_S:
                continue
            self.standby_launching[node] = now
            c.engine.start_pod(self._standby_plan(node))

    def _settled(self) -> bool:
        """New standby launchers are not started while a recovery runs: their spares importing
        beside ranks that restart on the same node would slow the very restart (a standby
        launcher a recovery took is replaced once the job trains again)."""
        return self.c.recoveries.active is None

    def _standby_plan(self, node: str) -> LaunchPlan:
        c = self.c
        template = commands.launch_plan(c, next(iter(c.pods.values())).row)
        return LaunchPlan(
            **{
                **template.__dict__,
                "pod": -1,
                "generation": 0,
                "node": node,
                # the first chips of its node: the pod it is kept for is the node's first
                "env": commands.plan_environment(c, node, tuple(range(c.spec.chips_per_pod))),
                "first_rank": 0,
                "workdir": str(c.layout.job(c.job_id).standby(node).path),
                "warm_spares": c.spec.warm_spares,
                "standby": True,
                # Once the job trains, a new standby launcher's spares start one at a time:
                # on nodes that share a machine (the embedded cluster) they import beside ranks.
                "spares_at_once": c.progress.step is None,
            }
        )

    def standby_hello(self, link: LauncherLink) -> bool:
        """A standby launcher said hello: kept if its node wants one, refused otherwise."""
        node = link.node
        self.standby_launching.pop(node, None)
        current = self.standby.get(node)
        wanted = self._keeps_standby(node) or node in self.awaiting_launcher()
        if not wanted or (
            current is not None and not current.peer.closed and current.pid != link.pid
        ):
            return False
        self.standby[node] = link
        self.c.event(EventKind.STANDBY_STARTED, node=node, spares=self.c.spec.warm_spares)
        return True

    # -- fencing --------------------------------------------------------------------------------

    def _write_fence(self) -> None:
        """A pod moved off a lost node (hung or cut off, it may still run the old pod) gets its
        new generation written to the fence before it starts; the SDK refuses a checkpoint
        from any older generation of that pod. Pods stopped in order (on nodes that answer) are
        not fenced: their dying gasp is part of the recovery."""
        c = self.c
        for pod in c.pods.values():
            row = pod.row
            seen = self.placed.get(row.idx)
            if seen is not None and seen[0] != row.generation:
                old = c.node(seen[1])
                if old is None or old.state is NodeState.LOST:
                    self.fenced[row.idx] = max(self.fenced.get(row.idx, 0), row.generation)
            self.placed[row.idx] = (row.generation, row.node)
        fence = {"generations": {str(k): v for k, v in sorted(self.fenced.items())}}
        if fence == self.fence_written:
            return
        path = c.layout.job(c.job_id).fence
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(fence))
        self.fence_written = fence
