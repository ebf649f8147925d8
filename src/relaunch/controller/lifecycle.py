"""A controller's life: listening for peers, starting or resuming a job, running the loop until
the job ends, and shutting its pods and agents down."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from relaunch.controller.active import RecoveryPhase
from relaunch.controller.clock import TICK_S
from relaunch.controller.commands import master_port, request_heal, slow_window_unusable, stop_grace
from relaunch.controller.listener import Listener
from relaunch.errors import SpecError
from relaunch.events import EventKind, fault_fields
from relaunch.faults import Fault, FaultKind
from relaunch.protocol.messages import ForgetCopies, Shutdown
from relaunch.protocol.wire import write_controller_address
from relaunch.spec import parse_job
from relaunch.states import StopCause
from relaunch.store import JobRow, JobStatus, NodeState

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext
    from relaunch.controller.peers import Peer

__all__ = ["adopted", "listen", "run", "stop"]

AGENTS_START_S: Final = 15.0
"""How long a start waits for the node agents it started to connect."""
AGENTS_FORGET_S: Final = 30.0
"""How long a job's end waits for its agents to remove their nodes' copies of it and exit."""


def listen(c: ControllerContext) -> Listener:
    """Accept agents and launchers; the controller's loop reads their messages (Controller.drain)."""
    listener = Listener(c.engine.bind_host, c.engine.listen_port)
    c.listener = listener
    host, port = listener.address
    write_controller_address(c.layout.path, host, port, pid=os.getpid())
    c.engine.listening(host, port)
    return listener


def run(c: ControllerContext) -> tuple[JobStatus, str]:
    listener = listen(c)
    try:
        now = c.clock.now()
        unusable = slow_window_unusable(c.hang_s, c.spec.replicas, c.cluster.slow_window_s)
        if unusable is not None:
            c.event(EventKind.SETTING_UNUSABLE, setting="slow_window_s", why=unusable)
        if c.options.resume:
            resume(c, now)
        else:
            start_agents(c, now)
            c.move_job(
                JobStatus.RUNNING,
                attempt_started_at=now,
                master_port=master_port(c),
                controller_seen_at=now,
            )
            c.membership.publish()
        while not c.job.status.ended:
            c.step(wait=max(0.0, c.pacer.next_pass - c.clock.now()))
        finish(c, c.job)
        return c.job.status, c.job.reason
    finally:
        c.listener = None
        listener.close()


def start_agents(c: ControllerContext, now: float, keep_lost: bool = False) -> None:
    """Start every node's agent and wait (draining messages) for them to connect. A new run
    starts lost nodes again (the embedded cluster can); a resume keeps them lost."""
    wanted: set[str] = set()
    for spec in c.cluster.nodes:
        row = c.node(spec.name)
        if row is not None and row.state is NodeState.LOST:
            if keep_lost:
                continue
            c.store.set_node_state(spec.name, NodeState.READY, "agent started again")
        wanted.add(spec.name)
        c.engine.start_agent(
            spec,
            c.cluster.heartbeat_interval_s,
            c.cluster.adopt_grace_s,
            c.options.rules.network_blip_s,
        )
        c.agents.pop(spec.name, None)
    c.refresh_nodes()
    c.adoption.until = now + max(5.0, 4 * c.cluster.heartbeat_timeout_s)
    deadline = now + AGENTS_START_S
    while c.clock.now() < deadline and not wanted <= set(c.agents):
        c.drain(TICK_S)
    c.adoption.until = 0.0


def resume(c: ControllerContext, now: float) -> None:
    """Take over a job whose controller died: re-adopt the pods and agents that come back
    (`adopted` decides, once they have or the window has passed, what the others mean)."""
    job = c.job
    c.recoveries.resume(c.store.records(c.job_id))
    c.recoveries.waiting = True  # faults the dead controller stored and did not decide
    seen = job.controller_seen_at
    c.adoption.away_s = now - seen if seen is not None else 0.0
    if c.options.resumed_from is not None:  # nothing of it runs: past any adopt grace
        c.adoption.away_s = max(c.adoption.away_s, c.cluster.adopt_grace_s + 1.0)
    c.update_job(controller_seen_at=now)
    c.adoption.resuming = True
    c.adoption.until = now + max(2.0, 3 * c.cluster.heartbeat_interval_s)
    c.event(
        EventKind.CONTROLLER_RESUMED, job=job.name, attempt=job.attempt, away_s=c.adoption.away_s
    )


def adopted(c: ControllerContext, now: float) -> None:
    """The adoption window is over. A pod whose launcher did not come back while its node lives
    and no recovery is under way: its container died while the controller was away (a fault,
    once the launcher grace has passed); a recovery under way launches its pods itself. Away longer than the adopt grace, pods and agents end themselves: the missing agents
    are started again and, if pods are missing, the job is rebuilt at job level, recorded as
    relaunch's own outage (no restart budget spent)."""
    active = c.recoveries.active
    if active is not None and active.phase is RecoveryPhase.WAITING:
        c.recoveries.carry_on(active)  # what the killed controller had not sent yet
    elif active is not None and active.heal is not None and active.heal.ok is None:
        # the agent answered the killed controller's heal request (or will): ask again here
        why = request_heal(c, active)
        if why is not None:
            c.recoveries.failed(why)
    parked = c.membership.parked()
    missing = [p for p in c.pods.values() if not p.connected and p.index not in parked]
    grace = c.cluster.adopt_grace_s
    if c.adoption.away_s <= grace:
        if c.recoveries.active is None:  # a recovery under way launches its pods itself
            for pod in missing:
                pod.lost(now)
        return
    silent = [
        spec
        for spec in c.cluster.nodes
        if spec.name not in c.agents
        and (row := c.node(spec.name)) is not None
        and row.state is not NodeState.LOST
    ]
    for spec in silent:  # they exited after the adopt grace: started again, not lost
        c.engine.start_agent(
            spec, c.cluster.heartbeat_interval_s, grace, c.options.rules.network_blip_s
        )
    if silent:
        c.adoption.until = now + max(5.0, 4 * c.cluster.heartbeat_timeout_s)
    if not missing:
        return
    seen = (c.job.controller_seen_at or now) - c.adoption.away_s
    detail = _restarted(c, len(missing), grace)
    outage = Fault(FaultKind.CONTROLLER_OUTAGE, min(seen + grace, now), detail=detail)
    c.recoveries.fault(outage, f"outage:{c.job.attempt}:{seen:.3f}")


def _restarted(c: ControllerContext, missing: int, grace: float) -> str:
    """Says why the job restarts from its checkpoints (`missing` pods did not come back), and
    returns the outage fault's detail."""
    away = c.adoption.away_s
    if c.options.resumed_from is StopCause.WANTS_NODES:
        cause, detail = "wants-nodes", "stopped for want of nodes, resumed"
        why = "the job was stopped for want of nodes: restarting it from its checkpoints on the "
        why += "nodes it has now, no restart spent"
    elif c.options.resumed_from is not None:
        cause, detail = "hangup", "stopped by a hangup of its run's terminal (SIGHUP), resumed"
        why = "the job was stopped when the terminal of its run closed (SIGHUP): restarting it "
        why += "from its checkpoints, no restart spent"
    else:
        cause, detail = (
            "controller-away",
            f"controller away {away:.0f} s (adopt_grace_s {grace:g} s)",
        )
        why = f"{missing} pod(s) did not come back: the controller was away {away:.0f} s, longer "
        why += f"than adopt_grace_s ({grace:g} s), and they ended themselves; restarting the job "
        why += "from its checkpoints"
    c.event(
        EventKind.RESTARTED_FROM_CHECKPOINTS,
        cause=cause,
        pods=missing,
        away_s=away,
        grace_s=grace,
        why=why,
    )
    return detail


def finish(c: ControllerContext, job: JobRow) -> None:
    for fault_id, fault, _ in c.store.pending(c.job_id):
        c.store.drop_pending(c.job_id, fault_id)  # the job ended: nothing to decide
        c.event(EventKind.FAULT_AFTER_END, **fault_fields(fault))
    step = c.progress.step
    if step is not None:
        if step != job.last_step:
            c.update_job(last_step=step)
        c.store.add_progress(c.job_id, c.clock.now(), step)
    c.fault_plan.at_end(c.job)
    shutdown_pods(c)


def shutdown_pods(c: ControllerContext) -> None:
    """Every launcher stops its processes (with the grace) and exits; then the agents."""
    grace = stop_grace(c)
    links = [p.link for p in c.pods.values() if p.link is not None]
    links += list(c.reconciler.standby.values())
    for link in links:
        link.peer.send(Shutdown(grace))
    _until_closed(c, [link.peer for link in links], grace + 5)
    forgotten = _forgotten_copies(c)
    agents = [agent.peer for agent in c.agents.values()]
    for peer in agents:
        if forgotten:  # removed by the agent before it exits
            peer.send(ForgetCopies(((forgotten, c.job_id),)))
        peer.send(Shutdown())
    if forgotten:  # the engine's end kills what still runs: the agents' removals end first
        _until_closed(c, agents, AGENTS_FORGET_S)
    left = c.engine.shutdown()
    if left.count is not None:
        c.update_job(left_behind=left.count)
    if left.count:
        what = left.what
        named = f": {'; '.join(what[:8])}{' ...' if len(what) > 8 else ''}" if what else ""
        c.event(EventKind.LEFT_BEHIND, count=left.count, what=list(what), named=named)


def _until_closed(c: ControllerContext, peers: list[Peer], seconds: float) -> None:
    """Read on until every one of `peers` closed its connection, at most `seconds`."""
    deadline = c.clock.now() + seconds
    while c.clock.now() < deadline and not all(peer.closed for peer in peers):
        c.drain(TICK_S)


def ended_jobs_copies(jobs: Iterable[JobRow], current: int) -> tuple[tuple[str, int], ...]:
    """(`local_checkpoint_dir`, job) of every job but `current` that ended for good and kept
    copies on its nodes' disks, for each agent that joins to remove its node's (ForgetCopies):
    the copies of a job whose controller was killed between its end and its last message, and
    of a node lost during its job, are removed by the next job's agents. A job that may still be
    carried on (active, or stopped resumably) keeps its copies."""
    found = []
    for job in jobs:
        if job.id == current or not job.ended_for_good:
            continue
        try:
            directory = parse_job(job.spec["raw"]).local_checkpoint_dir
        except (SpecError, KeyError, TypeError):  # a job this version reads no more: none known
            continue
        if directory:
            found.append((directory, job.id))
    return tuple(found)


def _forgotten_copies(c: ControllerContext) -> str:
    """The job's local checkpoint directory, for the agents to remove their nodes' copies of it,
    where the job ended for good; "" where it keeps none or `relaunch run --resume` may carry it
    on (its ranks may restart on the same nodes)."""
    if not c.job.ended_for_good:
        return ""
    return c.spec.local_checkpoint_dir or ""


def stop(c: ControllerContext, reason: str, cause: StopCause) -> None:
    """Stop the job at the user's request (Ctrl-C, SIGTERM, a hangup)."""
    if not c.job.status.ended:  # a stop after the job ended leaves its end as it was
        c.move_job(JobStatus.STOPPED, reason=reason, cause=cause)
    c.fault_plan.at_end(c.job)
    shutdown_pods(c)
