"""Each message a peer sends, to what the controller observes and the faults it implies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaunch.controller import commands, stacks
from relaunch.controller.detectors import (
    active_at,
    chip_faults,
    collective_fault,
    corruption_fault,
    exit_fault,
    exit_source,
)
from relaunch.controller.peers import AgentLink, LauncherLink, Peer, Rank
from relaunch.controller.pods import PodPhase
from relaunch.events import EventKind, fault_fields
from relaunch.protocol.datagrams import RestoreTier, SdkPhase
from relaunch.protocol.messages import (
    AgentHello,
    CollectiveFailed,
    CorruptionFound,
    Exited,
    ForgetCopies,
    Healed,
    Heartbeat,
    Injected,
    LauncherHello,
    MembershipUpdate,
    Message,
    Output,
    ProgressBatch,
    RankPhase,
    Restored,
    Shutdown,
    Stacks,
    Started,
    Stopped,
    Usage,
)
from relaunch.store import NodeState

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext

__all__ = ["dispatch"]

PROGRESS_SAVED_EVERY_S = 0.5
"""The newest step is written to the store at most this often (the API's progress chart)."""


def dispatch(c: ControllerContext, peer: Peer, message: Message | None) -> None:
    if message is None or not message.ROUTINE:  # a start, an exit, a hello: the ranks change
        c.hang_watch.stale()
    match message:
        case None:
            _closed(c, peer)
            c.hurry()  # a torn-down launcher lets its pod's replacement start
        case AgentHello(node=node):
            c.agents[node] = AgentLink(peer, node, c.clock.now(), message.peer_memory)
            c.engine.agent_heard(node, peer, message)
            if c.ended_copies:
                peer.send(ForgetCopies(c.ended_copies))
        case LauncherHello():
            _launcher_hello(c, peer, message)
            c.hurry()  # its pod's processes start in this pass, not the next
        case Heartbeat():
            agent = c.agents.get(message.node)
            if agent is not None and agent.peer is peer:
                agent.last_heartbeat = c.clock.now()
                _chip_health(c, agent, message)
                if message.free_port:
                    c.engine.agent_heard(message.node, peer, message)
        case Healed(request=request, ok=ok):
            c.recoveries.healed(request, ok)
        case Injected():
            c.fault_plan.acknowledged(message)
        case Exited():
            link = c.launcher_of(peer) or c.launcher_of(peer, leaving=True)
            if link is not None:  # a leaving launcher's exits may be collateral of its fault
                _exited(c, link, message)
            c.hurry()  # a fault is decided, or the job's end seen, in this pass
        case _:
            link = c.launcher_of(peer)
            if link is not None:
                _from_launcher(c, link, message)


def _from_launcher(c: ControllerContext, link: LauncherLink, message: Message) -> None:
    now = c.clock.now()
    match message:
        case Started(attempt=attempt, at=at, pids=pids):
            for rank in pids:
                link.ranks[rank] = Rank(attempt, True, at, at)
            link.ranks_changed()
            if attempt < link.started_attempt:
                # a later start overtook this answer: the launcher found these ranks running
                # and kept them, so it is sent again once they are stopped
                link.started_attempt = attempt
        case Output(rank=rank, attempt=attempt, line=line):
            # with steps (the SDK), a rank's startup ends at its first step, not line
            _activity(c, link, rank, attempt, now, started=not c.progress.uses_sdk)
            if c.on_output is not None:
                c.on_output(link.pod, rank, line)
            if not c.progress.uses_sdk:
                _progressed(c, link, rank, attempt, None)
        case ProgressBatch(reports=reports, phases=phases, busy=busy):
            for rank_index, (busy_looks, looks) in busy.items():
                observed = link.ranks.get(rank_index)
                if observed is not None and observed.running:
                    observed.looked(now, busy_looks, looks, c.cluster.slow_window_s)
            if phases:
                _phases(c, link, phases, now)
            for report in reports:
                _step(c, link, report.rank, report.attempt, report.step, now, report.at)
        case Usage(attempt=attempt, ranks=ranks, working=working, stopped=stopped):
            for rank_index, (cpu, io) in ranks.items():
                observed = link.ranks.get(rank_index)
                if observed is None or observed.attempt != attempt:
                    continue
                halted = stopped.get(rank_index, 0)
                if halted:
                    observed.stopped_at = now
                    c.hang_watch.stale()  # a save it said it made no longer counts
                alive = active_at(observed, cpu, io, working.get(rank_index, 0), halted, now)
                if alive is not None:
                    observed.last_activity = max(observed.last_activity, alive)
                observed.usage = (now, float(cpu), int(io))
        case Stacks():
            stacks.received(c, link, message)
        case CollectiveFailed():
            if message.attempt == c.job.attempt:
                _collective_failed(c, link, message)
        case Restored():  # which tier served, on record
            _restored(c, link, message)
        case CorruptionFound():
            if message.attempt == c.job.attempt:
                _corruption_found(c, message)
        case Stopped(exited=exited):
            for rank, (attempt, code, signum) in exited.items():
                _ended(link, rank, attempt, code, signum)
            pod = c.pods.get(link.pod)
            if pod is not None and pod.link is link:
                pod.stopped(now)
            else:
                link.stopping = False
            c.hurry()  # the next attempt starts as soon as every pod has stopped


def _collective_failed(c: ControllerContext, link: LauncherLink, message: CollectiveFailed) -> None:
    """A fault (detectors.collective_fault), or a symptom put on record once a pod."""
    found = collective_fault(
        link, message, commands.links_down(c), c.recovery.operator_retry is not None
    )
    if found is not None:
        c.recoveries.fault(found.fault, found.source)
        c.hurry()
        return
    said, link.failed_collective = link.failed_collective, (message.generation, message.step)
    if said != link.failed_collective:
        c.event(
            EventKind.COLLECTIVE_UNLINKED,
            pod=link.pod,
            rank=message.rank,
            step=message.step,
            why=message.why[:160],
        )


def _corruption_found(c: ControllerContext, message: CorruptionFound) -> None:
    """R-45: a rank says the replicas' parameters differ; the fault names the culprit's node."""

    def node_of(rank: int) -> tuple[int, str] | None:
        pod = c.pods.get(rank // c.spec.procs_per_pod)
        return (pod.index, pod.row.node) if pod is not None else None

    at = c.fault_plan.injected_at(("corrupt", "job"), message.at)
    found = corruption_fault(message, node_of, at)
    if not c.store.has_fault_from(c.job_id, found.source):
        c.event(
            EventKind.CORRUPTION_FOUND,
            step=message.step,
            clean_step=message.clean_step,
            culprits=list(message.culprits),
            fingerprints=list(message.fingerprints),
            **fault_fields(found.fault),
        )
    c.recoveries.fault(found.fault, found.source)


def _restored(c: ControllerContext, link: LauncherLink, message: Restored) -> None:
    """A rank restored a checkpoint's step: the tier and node that served it, on record."""
    source = RestoreTier(message.tier).source(message.holder)
    fields = {"pod": link.pod, "rank": message.rank, "step": message.step, "source": source}
    c.event(EventKind.RESTORED, **fields, tier=message.tier, holder=message.holder)


def _phases(
    c: ControllerContext, link: LauncherLink, phases: tuple[RankPhase, ...], now: float
) -> None:
    c.hang_watch.stale()  # a save that begins or ends moves the hang window
    for phase in phases:
        observed = link.ranks.get(phase.rank)
        if observed is not None and observed.attempt == phase.attempt:
            if observed.phase == SdkPhase.CHECKPOINT != phase.phase:
                observed.save_ended_at = now
            observed.phase = phase.phase
            observed.phase_since = now
            observed.last_activity = now  # a phase is a sign of life


def _activity(
    c: ControllerContext,
    link: LauncherLink,
    rank: int,
    attempt: int,
    now: float,
    started: bool = True,
) -> None:
    """A sign of life of a rank; `started`: one that ends its startup allowance (a step, or a
    line of a script that reports no steps): its window is the hang window from now."""
    observed = link.ranks.get(rank)
    if observed is not None and observed.attempt == attempt:
        if started and not observed.progressed:
            c.hang_watch.stale()
            observed.progressed = True
        observed.last_activity = now


def _step(
    c: ControllerContext,
    link: LauncherLink,
    rank: int,
    attempt: int,
    step: int,
    now: float,
    reported_at: float | None = None,
) -> None:
    _activity(c, link, rank, attempt, now)
    progress = c.progress
    progress.uses_sdk = True
    c.membership.joined(rank)
    progress.step = max(progress.step or 0, step)
    if now - progress.saved_at > PROGRESS_SAVED_EVERY_S:
        progress.saved_at = now
        c.update_job(last_step=progress.step)
        c.store.add_progress(c.job_id, now, progress.step)
    _progressed(c, link, rank, attempt, step, reported_at)


def _progressed(
    c: ControllerContext,
    link: LauncherLink,
    rank: int,
    attempt: int,
    step: int | None,
    reported_at: float | None = None,
) -> None:
    observed = link.ranks.get(rank)
    started_at = observed.started_at if observed is not None else 0.0
    c.recoveries.progressed(rank, started_at, attempt, step, reported_at)


def _ended(
    link: LauncherLink, rank: int, attempt: int, code: int | None, signum: int | None
) -> Rank:
    """A rank's process is gone (of `attempt`: its record is made if none was)."""
    observed = link.ranks.setdefault(rank, Rank(attempt))
    observed.running = False
    observed.code, observed.signal = code, signum
    link.ranks_changed()
    return observed


def _exited(c: ControllerContext, link: LauncherLink, message: Exited) -> None:
    observed = _ended(link, message.rank, message.attempt, message.code, message.signal)
    pod = c.pods.get(link.pod)
    node = pod.row.node if pod is not None else link.node
    if message.code == 0 and not message.signal:
        return
    started_at = observed.started_at if observed.attempt == message.attempt else 0.0
    if message.attempt != c.job.attempt:  # an attempt that ended: its fault's collateral, or old
        found = exit_fault(link, node, message, lambda _key, at: at)
        if found is not None:
            c.recoveries.collateral(found.fault, found.source, message.attempt, started_at)
        return
    found = exit_fault(link, node, message, c.fault_plan.injected_at)
    if found is not None:
        c.recoveries.fault(found.fault, found.source, message.attempt, started_at)


def _chip_health(c: ControllerContext, agent: AgentLink, beat: Heartbeat) -> None:
    """A node's chips and link, as its heartbeat says: the node's state follows, and each fault
    reported is a fault (stored once). The store hears of a heartbeat only when what it says
    changed; the time of the last one with the others' every HEARTBEAT_WRITTEN_EVERY_S
    (Controller.pass_)."""
    now = c.clock.now()
    _link_state(agent, beat.link_down, now)
    agent.data_rtt_ms = beat.data_rtt_ms
    chips = tuple((f.chip, f.code, f.kind) for f in beat.chips)
    if chips != agent.chips_written:
        agent.chips_written, agent.written_at = chips, now
        c.store.set_chip_health(
            beat.node,
            [{"chip": chip, "code": code, "kind": kind} for chip, code, kind in chips],
            now,
        )
    row = c.node(beat.node)
    if beat.chips and row is not None and row.state is NodeState.READY:
        c.store.set_node_state(beat.node, NodeState.FAULTY, "chip fault reported")
        c.refresh_node(beat.node)
    elif not beat.chips and row is not None and row.state is NodeState.FAULTY:
        c.store.set_node_state(beat.node, NodeState.READY, "chips healthy")
        c.refresh_node(beat.node)
    if not beat.chips and beat.link is None:
        return
    pod = next((p.index for p in c.pods.values() if p.row.node == beat.node), None)
    for found in chip_faults(beat, pod, c.fault_plan.injected_at):
        c.recoveries.fault(found.fault, found.source)


def _link_state(agent: AgentLink, down: bool, now: float) -> None:
    """While a node's data link is down its ranks (and every peer in a collective with them)
    wait for the network; once it is back, TCP's next resend comes at most the outage's length
    later (its interval doubles with every try): they wait until then too."""
    if down:
        agent.link_down_since = agent.link_down_since or now
        agent.network_waited_until = now
    elif agent.link_down_since is not None:
        agent.network_waited_until = now + (now - agent.link_down_since)
        agent.link_down_since = None


def _launcher_hello(c: ControllerContext, peer: Peer, hello: LauncherHello) -> None:
    if hello.job != c.job_id:
        peer.send(Shutdown(0.0))
        return
    link = LauncherLink(peer, hello.pod, hello.generation, hello.pid, node=hello.node)
    c.linked(link)
    now = c.clock.now()
    for rank, report in hello.procs.items():
        link.ranks[rank] = Rank(  # a rank that trained before a resume is not starting up
            report.attempt, report.running, now, now, progressed=report.progressed, code=report.code
        )
    link.started_attempt = hello.attempt
    if hello.standby:
        if not c.reconciler.standby_hello(link):
            peer.send(Shutdown(0.0))
        return
    pod = c.pods.get(hello.pod)
    if pod is None or pod.row.generation != hello.generation:
        peer.send(Shutdown(0.0))
        return
    current = pod.link
    if current is not None and not current.peer.closed and current.pid != hello.pid:
        peer.send(Shutdown(0.0))  # a duplicate started across a controller restart
        return
    pod.connect(link, now)
    membership = c.membership.current()
    if c.recovery.process_level and membership is not None:
        peer.send(MembershipUpdate(membership))
    for rank, report in hello.procs.items():
        if report.running or report.attempt != c.job.attempt or not report.code:
            continue
        # a rank that failed while no controller heard it (its exit was sent to one that was
        # dying): the hello is all that says so, and an exit no fault was stored for is one
        if not c.store.has_fault_from(
            c.job_id, exit_source(report.attempt, hello.generation, rank)
        ):
            code, signum = (None, -report.code) if report.code < 0 else (report.code, None)
            _exited(c, link, Exited(rank, report.attempt, code, signum, now))
    c.reconciler.connected(pod)


def _closed(c: ControllerContext, peer: Peer) -> None:
    """A peer's connection closed: if it was a launcher, its pod lost it (or its teardown is
    over), or its node's standby launcher is gone. Found by the peer, not by a look at every
    pod: a job-level rescheduling closes thousands."""
    link = c.links.pop(id(peer), None)
    if link is None:
        return  # an agent (its silence is the heartbeat's), or a launcher never linked
    pod = c.pods.get(link.pod)
    if pod is not None:
        if pod.leaving is link:
            pod.leaving = None
        if pod.link is link and pod.phase is not PodPhase.PARKED:
            pod.lost(c.clock.now())
    if c.reconciler.standby.get(link.node) is link:
        del c.reconciler.standby[link.node]
