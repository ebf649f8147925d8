"""What the controller's parts ask of pods, agents and the engine, and the views they decide on:
placement, the cluster view the policy reads, a pod's environment and launch plan, graces."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from relaunch import failpoints
from relaunch.controller.active import HEAL_TIMEOUT_S, ActiveRecovery, HealRequest
from relaunch.diagnosis import MIN_LOOKS, look_interval_s
from relaunch.events import EventKind
from relaunch.faults import Fault, FaultKind
from relaunch.policy import ClusterView, PodView
from relaunch.policy.elastic import ScaleOut
from relaunch.policy.placement import NodeCapacity, rebuild_slots
from relaunch.policy.placement import free_nodes as _free
from relaunch.protocol.datagrams import SdkPhase
from relaunch.protocol.environment import AttemptEnvironment, PodEnvironment
from relaunch.protocol.layout import PodDir, StateDir
from relaunch.protocol.messages import Heal, Shutdown, Start, Stop
from relaunch.protocol.plans import LaunchPlan
from relaunch.spec import RecoverySettings, process_recovery_env
from relaunch.store import NodeState, PodRow

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext

__all__ = [
    "cluster_view",
    "faulty_ranks",
    "free_nodes",
    "launch_plan",
    "master_port",
    "park",
    "pod_environment",
    "request_heal",
    "restart_ranks",
    "said_stopping",
    "stop_grace",
    "unpark",
]


def capacities(c: ControllerContext) -> list[NodeCapacity]:
    return [NodeCapacity(n.name, n.chips, n.schedulable) for n in c.nodes.values()]


def free_nodes(c: ControllerContext, used: set[str]) -> list[str]:
    """Standby nodes with a live agent: schedulable, chips for a pod, no pod of `used` on them."""
    return [n for n in _free(capacities(c), used, c.spec.chips_per_pod) if n in c.agents]


def master_port(c: ControllerContext, node: str | None = None) -> int:
    """A port free on the node of rank 0 (pod 0; `node`: where a decision moves it), for
    MASTER_PORT."""
    return c.engine.free_port(node or c.pods[0].row.node)


def checkpoint_saving(c: ControllerContext) -> bool:
    """Whether a running rank of the current attempt says it saves a checkpoint now."""
    return any(
        r.saving
        for p in c.pods.values()
        if p.link is not None
        for r in p.link.ranks.values()
        if r.attempt == c.job.attempt and r.running
    )


def cluster_view(c: ControllerContext, fault: Fault, ranks: RanksNow | None = None) -> ClusterView:
    """The facts a decision depends on, as observed now (R-31, R-37, R-41, placement); `ranks`:
    the look at every rank `ranks_now` just took, if one was (tens of thousands of ranks)."""
    used = {p.row.node for p in c.pods.values()}
    standby = tuple(
        n.name
        for n in c.nodes.values()
        if n.schedulable and n.name not in used and n.chips >= c.spec.chips_per_pod
    )
    failed, phases_of = ranks if ranks is not None else ranks_now(c)
    faulty = faulty_pods(c, fault) | failed
    # R-37 asks whether ranks that live on are saving or building their group: a rank on a lost
    # node is gone whatever it was doing (and its last phase may never have reached the
    # controller: a starved launcher forwards it late, then its node went)
    gone = failed | {p.index for p in c.pods.values() if _node_lost(c, p.row.node)}
    phases = {phase for pod, seen in phases_of.items() if pod not in gone for phase in seen}
    started = c.job.attempt_started_at or fault.at
    from relaunch.policy.fallback import FAILED_AT_START_S

    return ClusterView(
        pods=tuple(PodView(p.index, p.row.node, holds_rank0=p.index == 0) for p in c.pods.values()),
        standby_nodes=standby,
        checkpoint_saving=SdkPhase.CHECKPOINT in phases,
        group_building=SdkPhase.GROUP in phases,
        faulty_pods=frozenset(faulty),
        all_pods_failed_at_start=(
            fault.kind is FaultKind.PROCESS_EXIT
            and fault.at - started < FAILED_AT_START_S
            and len(failed) == len(c.pods)
        ),
        slots=rebuild_slots(capacities(c), c.spec.chips_per_pod),
        nodes=tuple(capacities(c)),
        chips_per_pod=c.spec.chips_per_pod,
    )


def failed_and_saving(c: ControllerContext, ranks: RanksNow | None = None) -> tuple[int, bool]:
    """How many pods have a rank that failed, and whether a rank that lives on saves a
    checkpoint (R-37, R-41: what the policy's hold asks), in one look at every rank."""
    failed, phases = ranks if ranks is not None else ranks_now(c)
    gone = failed | {p.index for p in c.pods.values() if _node_lost(c, p.row.node)}
    saving = any(SdkPhase.CHECKPOINT in seen for pod, seen in phases.items() if pod not in gone)
    return len(failed), saving


RanksNow = tuple[set[int], dict[int, set[str]]]
"""The pods with a rank that failed, and the SDK phases of each pod's running ranks."""


def ranks_now(c: ControllerContext) -> RanksNow:
    """In one look at every rank of the current attempt: the pods with a rank that failed, and
    the SDK phases of each pod's running ranks."""
    attempt = c.job.attempt
    failed: set[int] = set()
    phases: dict[int, set[str]] = {}
    for pod in c.pods.values():
        if pod.link is None:
            continue
        for rank in pod.link.ranks.values():
            if rank.attempt != attempt:
                continue
            if rank.running:  # a rank stopped in its save is not saving
                phase = rank.phase if rank.saving or rank.phase != SdkPhase.CHECKPOINT else ""
                phases.setdefault(pod.index, set()).add(phase)
            elif rank.code or rank.signal:
                failed.add(pod.index)
    return failed, phases


def _node_lost(c: ControllerContext, name: str) -> bool:
    node = c.node(name)
    return node is not None and node.state is NodeState.LOST


def faulty_pods(c: ControllerContext, fault: Fault) -> set[int]:
    """Pods with another fault now, besides `fault`'s own (R-31's rank-0 rule): a node that
    reports a chip or link fault, or that is lost."""
    found = set()
    for pod in c.pods.values():
        if pod.index == fault.pod or (fault.node is not None and pod.row.node == fault.node):
            continue
        node = c.node(pod.row.node)
        if node is not None and (node.chip_faults or node.state is not NodeState.READY):
            found.add(pod.index)
    return found


def faulty_ranks(c: ControllerContext, fault: Fault) -> tuple[int, ...]:
    """The processes a process-level in-place restart replaces: the one that failed, or the
    one driving the faulty chip."""
    if fault.rank is not None:
        return (fault.rank,)
    if fault.pod is not None and fault.chip is not None:
        ppp = c.spec.procs_per_pod
        return (fault.pod * ppp + fault.chip % ppp,)
    return ()


def links_down(c: ControllerContext) -> list[str]:
    """The nodes of the job whose data link their agent says is down now."""
    used = {p.row.node for p in c.pods.values()}
    return sorted(
        name for name, agent in c.agents.items() if name in used and agent.link_down_since
    )


def restart_ranks(c: ControllerContext, ranks: tuple[int, ...]) -> None:
    """Stop (at once) and start again only these ranks, in their pod's container."""
    if not ranks:
        return
    pod = c.pods.get(ranks[0] // c.spec.procs_per_pod)
    link = pod.link if pod is not None else None
    if pod is None or link is None:
        return
    running = tuple(r for r in ranks if (rank := link.ranks.get(r)) is not None and rank.running)
    if running:  # a process on a faulty chip still runs: replace it
        link.peer.send(Stop(0.0, running))
    attempt = c.job.attempt
    link.peer.send(Start(attempt, pod_environment(c, pod.row, attempt), ranks))


def park(c: ControllerContext, pods: Iterable[int]) -> None:
    """Elastic scale-in: the pods leave the job; their launchers are shut down at once."""
    now = c.clock.now()
    for index in pods:
        pod = c.pods[index]
        if pod.link is not None:
            pod.link.peer.send(Shutdown(0.0))
        pod.park(now)


def unpark(c: ControllerContext, decided: ScaleOut, now: float) -> None:
    """Scale-out (R-33): the parked pods the policy sends back get new containers on their nodes."""
    for index, node, counters in decided.back:
        row = c.pods[index].row
        generation = row.generation + 1
        workdir = c.layout.job(c.job_id).pod_path(index, generation)
        c.put_pod(
            PodRow(
                c.job_id,
                index,
                node,
                generation,
                counters.schedule_cnt,
                counters.proc_start_cnt,
                workdir,
            )
        )
        c.pods[index].placed(now)
        c.event(EventKind.SCALED_OUT, pod=index, node=node)


def request_heal(c: ControllerContext, active: ActiveRecovery) -> str | None:
    """In-place recovery asks the fault's node to heal its chips (or link); the answer, or its
    absence by the deadline, decides whether the processes start again. Returns why the
    recovery cannot work when no heal can be asked (the caller fails it), else None."""
    node = active.fault.node or ""
    agent = c.agents.get(node)
    heal = HealRequest(c.recoveries.next_heal_request(), node, c.clock.now() + HEAL_TIMEOUT_S)
    active.heal = heal
    if agent is None:  # nobody to heal it: a network fault heals itself when the link returns
        heal.ok = active.fault.kind is FaultKind.NETWORK
        return None if heal.ok else f"{node or 'its node'} has no agent to heal the chip"
    agent.peer.send(Heal(heal.request))
    return None


def stop_grace(c: ControllerContext) -> float:
    """SIGTERM -> SIGKILL grace for the processes being stopped: the job's termination grace,
    bounded by its hang grace when they are stopped because the job hung (a hung process
    cannot save; waiting 900 s for it only stalls the job)."""
    grace = c.recovery.termination_grace_s
    if c.recoveries.hang_stop:
        grace = min(grace, c.recovery.hang_grace_s)
    return grace


def said_stopping(c: ControllerContext, pods: int, containers: str) -> None:
    hang = c.recoveries.hang_stop
    c.event(
        EventKind.STOPPING,
        pods=pods,
        containers=containers,
        grace_s=stop_grace(c),
        hang=hang,
        why_text="; the job hung: hang grace" if hang else "",
    )
    failpoints.reach("stopping")


def suspects(c: ControllerContext, fault: Fault) -> tuple[int, ...]:
    """The ranks whose memory `fault` may have touched: the one driving its chip (or the rank
    that reported it), else every rank of its pod."""
    ranks = faulty_ranks(c, fault)
    if not ranks and fault.pod is not None:
        ranks = c.ranks_of(fault.pod)
    return ranks


def pod_environment(c: ControllerContext, row: PodRow, attempt: int) -> dict[str, str]:
    """R-04 to R-07: what every process of the pod sees (RANK and LOCAL_RANK are the launcher's):
    its attempt's variables, built once an attempt, and its own."""
    shared = _attempt_variables(
        c.spec.name,
        c.job_id,
        attempt,
        c.spec.world_size,
        c.spec.procs_per_pod,
        c.engine.node_address(c.pods[0].row.node),
        c.job.master_port,
        _shared_dir(c.layout, c.job_id),
        c.recovery,
    )
    return PodEnvironment(
        pod=row.idx,
        node=row.node,
        generation=row.generation,
        schedule_cnt=row.schedule_cnt,
        proc_start_cnt=row.proc_start_cnt,
        membership_file=(
            str(PodDir(Path(row.workdir)).membership) if c.recovery.process_level else None
        ),
        peer_memory=_peer_memories(c) if c.spec.peer_memory_mb else "",
        peer_memory_bytes=c.spec.peer_memory_mb << 20,
        local_checkpoints=c.spec.local_checkpoint_dir or "",
        integrity_every=c.spec.integrity_check_every,
    ).variables(shared)


def _peer_memories(c: ControllerContext) -> str:
    """The peer memories of the nodes whose agents are connected now: ``node=host:port,...``."""
    return _joined(tuple(sorted((n, a.peer_memory) for n, a in c.agents.items() if a.peer_memory)))


@functools.lru_cache(maxsize=16)
def _joined(memories: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{node}={address}" for node, address in memories)


@functools.lru_cache(maxsize=64)
def _attempt_variables(
    job_name: str,
    job_id: int,
    attempt: int,
    world_size: int,
    procs_per_pod: int,
    master_addr: str,
    master_port: int,
    shared_dir: str,
    recovery: RecoverySettings,
) -> Mapping[str, str]:
    """An attempt's variables, by what they are made of (a pod 0 moved, a new port: another)."""
    process_level = recovery.process_level
    return MappingProxyType(
        AttemptEnvironment(
            job_name=job_name,
            job_id=job_id,
            attempt=attempt,
            world_size=world_size,
            procs_per_pod=procs_per_pod,
            master_addr=master_addr,
            master_port=master_port,
            shared_dir=shared_dir,
            process_recovery=process_recovery_env(recovery),
            recovery_wait_s=recovery.wait_reschedule_timeout_s if process_level else None,
            step_rollback=recovery.step_rollback.value if process_level else None,
            run_id=f"{job_name}-{job_id}",
            max_restarts=recovery.job_retry_budget,
        ).variables()
    )


@functools.cache
def _shared_dir(layout: StateDir, job_id: int) -> str:
    """The job's shared directory, as every start of thousands of pods names it."""
    return str(layout.job(job_id).shared)


LEAD_PROGRESS_S = 1.0
"""How often, at most, pod 0's launcher forwards its ranks' steps: the job's step (the newest
any rank reported) that the progress chart, goodput and `at_step` faults follow."""

PROGRESS_AT_MOST_S = 5.0
"""How often, at most, any other pod's launcher does: its ranks' output reaches the job's log
at least this often."""


def progress_interval(hang_s: float, replicas: int, slow_window_s: float, pod: int = 0) -> float:
    """How often a launcher forwards its ranks' newest steps (a rank's first step in an attempt
    and SDK phases go at once), reads their output and looks at whether they are busy: a
    twentieth of the hang window, so that hang detection loses nothing, and often enough for
    the slow-pod window to hold the looks it needs (a short `slow_window_s`); for pod 0 at most
    LEAD_PROGRESS_S (the job's step needs one pod), for the others PROGRESS_AT_MOST_S (with
    the defaults, a 1800 s hang window and a 60 s slow window, 3 s: a launcher wakes a third as
    often as at 1 s); longer for very large jobs (0.002 s a pod), so that the controller hears
    a few hundred batches a second at most."""
    cap = LEAD_PROGRESS_S if pod == 0 else PROGRESS_AT_MOST_S
    return max(0.02, min(cap, hang_s / 20, look_interval_s(slow_window_s)), 0.002 * replicas)


def slow_window_unusable(hang_s: float, replicas: int, slow_window_s: float) -> str | None:
    """Why slow-pod detection cannot work for a job, where it cannot: its launchers look at the
    ranks too seldom (a very large job) for `slow_window_s` to hold MIN_LOOKS."""
    if slow_window_s <= 0:
        return None
    interval = progress_interval(hang_s, replicas, slow_window_s, pod=1)  # the longest
    if slow_window_s / interval >= MIN_LOOKS:
        return None
    return (
        f"slow-pod detection is off for this job: its launchers look at the ranks every "
        f"{interval:g} s, so the cluster's slow_window_s of {slow_window_s:g} s holds "
        f"{int(slow_window_s / interval)} looks, fewer than the {MIN_LOOKS} a share needs; "
        f"set slow_window_s to {MIN_LOOKS * interval:g} s or more"
    )


def pod_chips(c: ControllerContext, row: PodRow) -> tuple[int, ...]:
    """The chips of its node a pod has (the node's own indices): the pods on a node take its
    chips in pod order, `chips_per_pod` each, as a device plugin or Slurm's gres would give a
    container its own."""
    on_node = sorted(
        {p.index for p in c.pods.values() if p.row.node == row.node and p.index != row.idx}
        | {row.idx}
    )
    per = c.spec.chips_per_pod
    slot = on_node.index(row.idx)
    return tuple(range(slot * per, (slot + 1) * per))


def visible_devices(c: ControllerContext, node: str, chips: tuple[int, ...]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES naming the machine's GPUs that `chips`
    of `node` are, where the engine's chips are GPUs (none where they are simulated): a pod's
    ranks see their own GPUs only, and LOCAL_RANK picks among them as on a real host."""
    spec = next((n for n in c.cluster.nodes if n.name == node), None)
    if not c.engine.facts.chips_are_gpus or spec is None:
        return {}
    gpus = ",".join(str(spec.first_gpu + chip) for chip in chips if chip < spec.chips)
    return {"CUDA_VISIBLE_DEVICES": gpus, "NVIDIA_VISIBLE_DEVICES": gpus} if gpus else {}


def plan_environment(c: ControllerContext, node: str, chips: tuple[int, ...]) -> dict[str, str]:
    """What a launcher on `node` gives its processes beyond its pod's own: the engine's, the
    GPUs `chips` are, and the job's environment, which wins."""
    return {**c.engine.pod_environment(node), **visible_devices(c, node, chips), **c.spec.env}


def launch_plan(c: ControllerContext, row: PodRow) -> LaunchPlan:
    """The one way a pod's launcher is described (a standby launcher's derives from it)."""
    return LaunchPlan(
        job=c.job_id,
        job_name=c.spec.name,
        pod=row.idx,
        generation=row.generation,
        node=row.node,
        command=tuple(c.spec.command),
        procs_per_pod=c.spec.procs_per_pod,
        first_rank=row.idx * c.spec.procs_per_pod,
        working_dir=c.spec.working_dir,
        monitor_interval_s=c.recovery.monitor_interval_s,
        adopt_grace_s=c.cluster.adopt_grace_s,
        workdir=row.workdir,
        env=plan_environment(c, row.node, pod_chips(c, row)),
        host_processes=c.spec.world_size
        if c.engine.facts.nodes_share_cores
        else c.spec.procs_per_pod,
        warm_spares=c.spec.warm_spares,
        progress_interval_s=progress_interval(
            c.hang_s, c.spec.replicas, c.cluster.slow_window_s, row.idx
        ),
        termination_grace_s=c.recovery.termination_grace_s,
        activity_interval_s=min(30.0, max(0.2, c.hang_s / 5)),
        lease_s=c.cluster.lease_s,
        framework=c.recovery.framework.value,
    )
