"""Firing a job's fault plan: each due entry once, at its target as it is now.

An entry whose target has gone (its node isolated or lost, its pod parked, its rank exited) is
recorded as not fired, with the reason, and never holds back the entries after it; one whose
target is still starting waits for it. One injected fault at a time: the next waits until the
last was detected (or the startup allowance passed). The target acknowledges whether it fired.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from relaunch import failpoints
from relaunch.controller import commands
from relaunch.events import EventKind
from relaunch.faults.plan import LINK_KINDS, PlannedFault, PlannedFaultKind, parse_plan
from relaunch.protocol.links import Cut, LinkFaultKind
from relaunch.protocol.messages import (
    InjectChipFault,
    InjectCopyCorruption,
    Injected,
    InjectNetworkFault,
    InjectProcessFault,
    Message,
)
from relaunch.store import JobRow, JobStatus, NodeState

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext

__all__ = ["FaultPlanRunner"]

Key = tuple[str, str]


_PROCESS_FAULTS: Final = {
    PlannedFaultKind.PROCESS_EXIT: "exit",
    PlannedFaultKind.HANG: "hang",
    PlannedFaultKind.SILENT_CORRUPTION: "corrupt",
}
"""The launcher's name for each process fault of a plan (`slow` for the rest)."""


class FaultPlanRunner:
    def __init__(self, controller: ControllerContext, plan: tuple[PlannedFault, ...]) -> None:
        self.c = controller
        self.plan = plan
        self.injected: dict[Key, float] = {}
        """Faults injected and not yet detected, by what detects them: when they were sent."""
        self.unacknowledged: dict[int, Key] = {}
        self.warned = False
        self.finished = not plan
        """Every entry fired (or cannot) and was detected: nothing for the plan to time."""

    def injected_at(self, key: Key, default: float) -> float:
        """When a detected fault was injected by the plan (forgetting it), else `default`."""
        return self.injected.pop(key, default)

    def reload(self, stored: list[dict[str, object]]) -> None:
        """Entries added while the job runs (the API's POST .../faults)."""
        if len(stored) != len(self.plan):
            self.plan = parse_plan(stored, source="stored fault plan")
            self.finished = False
            self.c.event(EventKind.PLAN_RELOADED, entries=len(self.plan))

    def fire(self, now: float) -> None:
        c = self.c
        # A hang whose stacks are being captured is a fault not decided yet (controller.stacks).
        busy = c.recoveries.active is not None or c.recoveries.waiting or c.capture.busy
        if not self.plan or c.job.status is not JobStatus.RUNNING or busy:
            return
        for key, at in list(self.injected.items()):
            if now - at > c.startup_s:
                del self.injected[key]
        self.unacknowledged = {i: k for i, k in self.unacknowledged.items() if k in self.injected}
        if self.injected:
            return
        done = c.store.fired(c.job_id)
        if all(entry.index in done for entry in self.plan):
            self.finished = True
            return
        elapsed = now - (c.job.attempt_started_at or now)
        self._warn_silent(done, elapsed)
        # whether a rank saves (a look at every rank) only where an entry waits for a save
        saving = any(e.while_saving and e.index not in done for e in self.plan) and (
            commands.checkpoint_saving(c)
        )
        for entry in self.plan:
            if entry.index in done or not entry.due(c.progress.step, elapsed, saving):
                continue
            failpoints.reach("fault-plan-due")
            target = self._target(entry)
            if target is None:
                # its rank is (re)starting: it fires once the rank runs, and the entries after
                # it wait (a plan's faults strike in the order listed: a rank forked later
                # than a node fault was due once let the node fault go first)
                return
            if isinstance(target, str):
                self.not_fired(entry.index, target, now)
                continue
            c.store.mark_fired(c.job_id, entry.index, now)
            c.event(
                EventKind.PLAN_FIRED,
                entry=entry.index,
                planned=entry.kind.value,
                entry_text=entry.describe(),
            )
            self._inject(entry, *target, now)
            return  # one per pass, so each is seen on its own

    def _warn_silent(self, done: dict[int, tuple[float, str]], elapsed: float) -> None:
        """`at_step` entries wait for progress reports: say so once if none has come."""
        waiting = [e for e in self.plan if e.at_step is not None and e.index not in done]
        if self.warned or not waiting or self.c.progress.step is not None:
            return
        if elapsed > self.c.startup_s:
            self.warned = True
            self.c.event(EventKind.PLAN_WAITING, entries=len(waiting), elapsed_s=elapsed)

    def _target(self, entry: PlannedFault) -> tuple[str, int | None] | str | None:
        """Where `entry` fires now: (node, rank); a string saying why it cannot fire any more;
        or None while its target is starting."""
        c = self.c
        if entry.pod is not None:
            pod = c.pods.get(entry.pod)
            if pod is None:
                return f"job {c.spec.name} has no pod {entry.pod}"
            if entry.pod in c.membership.parked():
                return f"pod {entry.pod} is parked (elastic scale-in)"
            node_name = pod.row.node
        else:
            node_name = entry.node or ""
        node = c.node(node_name)
        if node is None:
            return f"node {node_name} is not in the cluster"
        if node.state in (NodeState.LOST, NodeState.ISOLATED):
            return f"node {node_name} is {node.state.value.lower()}"
        if entry.targets_process:
            assert entry.pod is not None
            rank = entry.target_rank(c.spec.procs_per_pod)
            link = c.pods[entry.pod].link
            observed = link.ranks.get(rank) if link is not None else None
            if observed is None or observed.attempt != c.job.attempt:
                return None
            if not observed.running:
                return f"rank {rank} has exited (code {observed.code}, signal {observed.signal})"
            return node_name, rank
        if entry.kind is not PlannedFaultKind.NODE_DOWN:
            if node_name not in c.agents:
                return None
            if (
                entry.kind in (PlannedFaultKind.CHIP_FAULT, PlannedFaultKind.MEMORY_UCE)
                and entry.chip >= node.chips
            ):
                return (
                    f"node {node_name} has {node.chips} chip(s); chip {entry.chip} does not exist"
                )
        return node_name, None

    def _inject(self, entry: PlannedFault, node: str, rank: int | None, now: float) -> None:
        c = self.c
        message: Message
        if entry.kind is PlannedFaultKind.NODE_DOWN:
            self.injected[("node", node)] = now
            c.engine.rehearsal.kill_node(node)
            return
        if entry.kind in LINK_KINDS:
            self._inject_link(entry, node, now)
            return
        if entry.kind is PlannedFaultKind.PEER_COPY_CORRUPT:  # nothing detects it: not awaited
            c.agents[node].peer.send(InjectCopyCorruption(entry.index, str(c.job_id)))
            return
        if entry.targets_process:
            assert entry.pod is not None and rank is not None
            kind = _PROCESS_FAULTS.get(entry.kind, "slow")
            key: Key = (kind, str(rank) if kind == "exit" else node if kind == "slow" else "job")
            message = InjectProcessFault(
                entry.index,
                kind,
                rank,
                entry.exit_code,
                entry.factor,
                entry.duration_s,
                entry.corruption.to_json(),
            )
            peer = c.pods[entry.pod].link
        else:
            key = ("chip", node)
            assert entry.code is not None
            message = InjectChipFault(
                entry.index, entry.chip, entry.code, entry.heals, entry.kind.value
            )
            peer = c.agents[node]  # type: ignore[assignment]
        self.injected[key] = now
        self.unacknowledged[entry.index] = key
        assert peer is not None
        peer.peer.send(message)

    def _inject_link(self, entry: PlannedFault, node: str, now: float) -> None:
        """A link fault, made real by the engine (its node's agent sees it and says so, or the
        node falls silent); where the engine cannot, a link down is simulated by the agent as
        before, and the other kinds are recorded not fired."""
        c = self.c
        kind = {
            PlannedFaultKind.NETWORK: LinkFaultKind.DOWN,
            PlannedFaultKind.PARTITION: LinkFaultKind.PARTITION,
            PlannedFaultKind.DEGRADED_LINK: LinkFaultKind.DEGRADED,
        }[entry.kind]
        why = c.engine.rehearsal.inject_link_fault(
            node, kind, entry.duration_s, entry.cut, entry.rate_mbit
        )
        if why is None:
            key = _detected_by(kind, entry.cut, node)
            if key is not None:
                self.injected[key] = now
            return
        if entry.kind is not PlannedFaultKind.NETWORK:
            self.not_fired(entry.index, f"a real link is needed: {why}", now)
            return
        c.event(EventKind.PLAN_SIMULATED, entry=entry.index, node=node, why=why)
        self.injected[("net", node)] = now
        self.unacknowledged[entry.index] = ("net", node)
        c.agents[node].peer.send(InjectNetworkFault(entry.index, entry.duration_s, entry.heals))

    def acknowledged(self, message: Injected) -> None:
        """A launcher or agent says whether an entry it was sent really fired."""
        key = self.unacknowledged.pop(message.index, None)
        if message.ok:
            return
        if key is not None:
            self.injected.pop(key, None)  # nothing will be detected: later entries go on
        self.not_fired(message.index, message.why or "the target refused it", self.c.clock.now())

    def not_fired(self, index: int, why: str, now: float) -> None:
        entry = next((e for e in self.plan if e.index == index), None)
        self.c.store.mark_fired(self.c.job_id, index, now, note=f"not fired: {why}")
        what = entry.describe() if entry is not None else f"entry {index}"
        self.c.event(EventKind.PLAN_NOT_FIRED, entry=index, what=what, why=why)

    def at_end(self, job: JobRow) -> None:
        """Every entry the job ended without firing is recorded as not fired, saying why."""
        if not self.plan:
            return
        done = self.c.store.fired(self.c.job_id)
        now = self.c.clock.now()
        elapsed = now - (job.attempt_started_at or now)
        for entry in self.plan:
            if entry.index not in done:
                self.not_fired(entry.index, self._why_unfired(entry, job, elapsed), now)

    def _why_unfired(self, entry: PlannedFault, job: JobRow, elapsed: float) -> str:
        step = self.c.progress.step
        if entry.while_saving and entry.due(step, elapsed, saving=True):
            return (
                f"the job ended ({job.status.value}) with no checkpoint saved once the entry "
                "was due (while_saving: the SDK's CheckpointManager says when it saves)"
            )
        if entry.due(step, elapsed):
            return (
                f"the job ended ({job.status.value}) while the entry waited for an earlier fault "
                "to be detected and recovered"
            )
        if entry.at_step is not None and step is None:
            return (
                "the job never reported a step (at_step needs the script to call "
                "relaunch.train.report_progress)"
            )
        if entry.at_step is not None:
            return f"the job ended ({job.status.value}) at step {step}, before step {entry.at_step}"
        return (
            f"the job ended ({job.status.value}) {elapsed:.1f} s into attempt {job.attempt}, "
            f"before {entry.after_s:g} s"
        )


def _detected_by(kind: LinkFaultKind, cut: Cut | None, node: str) -> Key | None:
    """What detects a real link fault: the agent's report of its data link, or the node's
    silence (a partition from the controller); a degraded link is found slow, later."""
    if kind is LinkFaultKind.DEGRADED:
        return None
    if kind is LinkFaultKind.PARTITION and cut in (Cut.CONTROLLER, Cut.BOTH):
        return ("node", node)
    return ("net", node)
