"""The checks of each pass: what the API asked, silent nodes, lost launchers, hangs, the end of
the job, and the end of an adoption. Each feeds the detectors and hands faults to the recovery
driver; none blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaunch.controller import lifecycle, stacks
from relaunch.controller.detectors import hang_look, launcher_faults, lost_nodes
from relaunch.controller.pods import Pod, PodPhase
from relaunch.diagnosis import MIN_LOOKS, slow_links, slow_pods
from relaunch.events import EventKind
from relaunch.faults import Fault, FaultKind
from relaunch.states import StopCause
from relaunch.store import JobStatus, NodeState

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext

__all__ = ["adoption", "done", "hangs", "heartbeats", "launchers", "requests", "slow"]

SLOW_CHECKED_EVERY_S = 1.0
"""How often the ranks' busy shares are compared (diagnosis.subhealth)."""


def adoption(c: ControllerContext, now: float) -> None:
    """A resume's adoption window ends when every agent and launcher is back, or at its
    deadline; then lifecycle.adopted says what the missing ones mean."""
    if not c.adoption.resuming:
        return
    live = {n.name for n in c.nodes.values() if n.state in (NodeState.READY, NodeState.FAULTY)}
    parked = c.membership.parked()
    back = live <= set(c.agents) and all(
        p.connected for p in c.pods.values() if p.index not in parked
    )
    if now < c.adoption.until and not back:
        return
    c.adoption.resuming = False
    c.adoption.until = now
    lifecycle.adopted(c, now)


def requests(c: ControllerContext, now: float) -> None:
    """What was asked of the job through the store (the API, `relaunch stop`)."""
    job = c.job
    if job.status.ended:
        return
    if job.stop_requested:
        c.move_job(
            JobStatus.STOPPED, reason=f"stopped: {job.stop_requested}", cause=StopCause.REQUEST
        )
        c.event(EventKind.STOPPING_JOB, why=job.stop_requested)
        return
    c.fault_plan.reload(job.plan)


def heartbeats(c: ControllerContext, now: float) -> None:
    """A node whose agent is silent for the heartbeat timeout, or that the engine reports dead,
    is lost (whichever comes first)."""
    if now < c.adoption.until:
        return
    found = lost_nodes(
        c.nodes.values(),
        c.agents,
        c.engine.lost_nodes(),
        min(now, c.caught_up_at),  # silent up to when everything sent was read
        c.cluster.heartbeat_timeout_s,
        c.adoption.until or now,
        c.fault_plan.injected_at,
    )
    for lost in found:
        c.store.set_node_state(lost.node, NodeState.LOST, lost.why)
        c.refresh_node(lost.node)
        c.agents.pop(lost.node, None)
        c.event(EventKind.NODE_LOST, node=lost.node, why=lost.why, silent_s=lost.silent_s)
        c.recoveries.fault(lost.detected.fault, lost.detected.source)


def launchers(c: ControllerContext, now: float) -> None:
    """A launcher that vanished while its node lives: the pod's container died."""
    grace = c.cluster.heartbeat_timeout_s + 2 * c.cluster.heartbeat_interval_s
    for pod, detected in launcher_faults(c.pods.values(), c.nodes, now, grace):
        pod.placed(now)  # it needs a launcher again, whatever the recovery decides
        c.recoveries.fault(detected.fault, detected.source)
    for pod in c.pods.values():
        if pod.phase is not PodPhase.LOST:
            continue
        node = c.node(pod.row.node)
        if pod.lost_since_moved or node is None or node.state is NodeState.LOST:
            pod.placed(now)  # moved since, or its node's loss is the fault: it needs a launcher


def hangs(c: ControllerContext, now: float) -> None:
    """R-25, with the joining ranks of a scale-out and the healthy ranks that wait for a
    process-level recovery's replacements left out; not while a fault waits for its decision
    (its recovery failed a moment ago: the ranks that waited for it are not hung)."""
    if c.capture.busy:  # a hang's stacks are being captured: decide it once they are
        hung = stacks.finish(c, now)
        if hung is not None:
            c.recoveries.fault(
                hung.fault, hung.source, evidence=hung.evidence, detected_at=hung.detected_at
            )
        return
    if c.job.status is not JobStatus.RUNNING and c.recoveries.active is None:
        return
    if c.recoveries.waiting:
        return  # a fault waits for its decision, later in this pass, which acts on these ranks
    if c.membership.joining and now < c.membership.joining_until:
        return  # a scale-out: the group waits for the joining ranks to start
    started = c.reconciler.started_everywhere(c.job.attempt)
    if started is None:
        return  # the attempt still starts: its started ranks wait for the rest (reconcile)
    active = c.recoveries.active
    waiting = active is not None and active.action.process_level
    exempt = active.ranks if waiting and active is not None else None
    # the ranks waited for the network, the last pod's start, or a process-level recovery's
    waited = max(network_waited_until(c), started, c.recoveries.waited_until)
    key = (c.job.attempt, exempt, waited, c.hang_s, c.startup_s)
    seen_up_to = min(now, c.caught_up_at)  # silent up to when everything sent was read
    if not c.hang_watch.must_look(seen_up_to, key):
        return
    links = [p.link for p in c.pods.values() if p.link is not None]
    look = hang_look(
        links,
        c.job.attempt,
        seen_up_to,
        c.hang_s,
        c.startup_s,
        lambda rank: exempt is not None and rank not in exempt,
        c.fault_plan.injected_at,
        waited,
    )
    c.hang_watch.looked(look, key)
    found = look.found
    if found is None:
        return
    for link in links:
        for rank in link.ranks.values():
            rank.last_activity = max(rank.last_activity, now)  # one hang fault per silence
    if not stacks.begin(c, found, now):
        c.recoveries.fault(found.fault, found.source)


def network_waited_until(c: ControllerContext) -> float:
    """The last moment a node of the job had its data link down (its ranks, and every peer in
    a collective with them, waited for the network until then)."""
    used = {p.row.node for p in c.pods.values()}
    return max(
        (a.network_waited_until for name, a in c.agents.items() if name in used), default=0.0
    )


def slow(c: ControllerContext, now: float) -> None:
    """A pod persistently slower than its peers (SubHealthFault): its ranks busy `slow_margin`
    more of the window than the other pods', or its node's data link many times slower than
    the others' (real links), at every check for half a window more. Not while a recovery runs
    or a fault waits (their stops and restarts are not slowness), nor, for the busy shares,
    before every rank of the attempt has a full window of looks."""
    window = c.cluster.slow_window_s
    watch = c.slow
    if window <= 0 or now - watch.checked_at < SLOW_CHECKED_EVERY_S:
        return
    watch.checked_at = now
    quiet = c.recoveries.active is None and not c.recoveries.waiting and not c.capture.busy
    if c.job.status is not JobStatus.RUNNING or not quiet:
        watch.since.clear()
        return
    parked = c.membership.parked()
    pods = [p for p in c.pods.values() if p.index not in parked]
    trained = _trained_a_window(c, pods, now)
    found: dict[int, str] = {}
    if trained:
        found = {link.pod: link.describe() for link in slow_links(_link_rtts(c, pods))}
    shares = _busy_shares(c, pods, now - window) if trained else None
    if shares is not None:
        # busier than its peers is the cause where both are seen: a slow link makes its ranks
        # wait, not compute (a machine beside a CPU hog and a disk writer answered a throttled
        # pod's node's probes 16 ms late, its peers' 2.5 ms: "link" named the wrong cause)
        for slowed in slow_pods(shares, c.cluster.slow_margin):
            found[slowed.pod] = slowed.describe()
    for index in list(watch.since):
        if index not in found:
            del watch.since[index]
    for index, why in found.items():
        since = watch.since.setdefault(index, now)
        if now - since < window / 2:
            continue
        pod = c.pods[index]
        fault = Fault(
            FaultKind.SLOW,
            max(since - window, c.job.attempt_started_at or since - window),
            node=pod.row.node,
            pod=index,
            detail=why,
        )
        c.recoveries.fault(fault, f"slow:{c.job.attempt}:{index}:{pod.row.generation}")
        watch.since.clear()
        return


def _trained_a_window(c: ControllerContext, pods: list[Pod], now: float) -> bool:
    """Every rank of the attempt, on the nodes its pods hold now, made progress a slow window
    ago or more. Before, the data links carry no training traffic (a degraded link queues no
    probe) and a start's load (thousands of imports on shared cores) only delays the probes'
    answers: a busy machine's link looked 15 times slower than its peers' (6 ms against 0.4)
    while its ranks imported. A pod moved within the attempt starts anew too: its ranks'
    imports and restore are no slowness (a pod moved off a degraded link was found slow again
    on its new node, in CI)."""
    watch, attempt = c.slow, c.job.attempt
    for pod in pods:
        ranks = pod.link.ranks.values() if pod.link is not None else ()
        running = [r for r in ranks if r.attempt == attempt and r.running]
        if not running or not all(r.progressed for r in running):
            return False
    placed = (attempt, tuple(sorted((p.index, p.row.node, p.row.generation) for p in pods)))
    if watch.training[0] != placed:
        watch.training = (placed, now)
    return now - watch.training[1] >= c.cluster.slow_window_s


def _link_rtts(c: ControllerContext, pods: list[Pod]) -> dict[int, float]:
    """Each pod's node's data-link round trip, where its agent measures one."""
    found = {}
    for pod in pods:
        agent = c.agents.get(pod.row.node)
        if agent is not None and agent.data_rtt_ms is not None:
            found[pod.index] = agent.data_rtt_ms
    return found


def _busy_shares(c: ControllerContext, pods: list[Pod], since: float) -> dict[int, float] | None:
    """Each pod's share of the window its ranks were busy; None until every rank of the
    attempt has a full window of looks (a start, a restart)."""
    shares: dict[int, float] = {}
    for pod in pods:
        if pod.link is None:
            return None
        ranks = [r for r in pod.link.ranks.values() if r.running and r.attempt == c.job.attempt]
        seen = [r.busy_share(since) for r in ranks]
        if not ranks or any(s is None or s[1] < MIN_LOOKS for s in seen):
            return None
        shares[pod.index] = sum(s[0] for s in seen if s is not None) / len(seen)
    return shares


def done(c: ControllerContext, now: float) -> None:
    """Every rank of the current attempt exited 0: the job succeeded."""
    if c.recoveries.waiting or c.job.status.ended:
        return  # a stored fault waits for its decision: the job is not done before it
    parked = c.membership.parked()
    attempt, ended = c.job.attempt, 0
    for pod in c.pods.values():
        if pod.index in parked:
            continue
        if pod.link is None:
            return
        for rank in pod.link.ranks.values():  # a job that trains stops at its first rank
            if rank.attempt == attempt:
                if rank.running or rank.code != 0:
                    return
                ended += 1
    if ended != (len(c.pods) - len(parked)) * c.spec.procs_per_pod:
        return
    c.recoveries.succeeded(now)  # every rank exited 0: the recovery under way worked
    c.move_job(JobStatus.SUCCEEDED, reason="every rank exited 0")
    c.event(EventKind.SUCCEEDED, job=c.spec.name)
