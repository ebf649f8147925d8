"""Detectors: observations in, faults out. Each returns the faults it sees with a `source`, a key
that is the same every time the same fault is observed again (a heartbeat repeats a chip fault; a
restarted controller hears the same exit), so that the store records each fault once.

Pure functions of what they are given; the controller feeds them and acts on what they return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from relaunch.controller.peers import AgentLink, LauncherLink, Rank
from relaunch.controller.pods import Pod, PodPhase
from relaunch.diagnosis import StackGroup
from relaunch.faults import LAUNCHER_DIED, Fault, FaultKind
from relaunch.protocol.messages import CollectiveFailed, CorruptionFound, Exited, Heartbeat
from relaunch.states import NodeState

if TYPE_CHECKING:
    from relaunch.store import NodeRow

__all__ = [
    "ACTIVE_CPU_SHARE",
    "SILENT_NODE",
    "Capture",
    "Detected",
    "HangLook",
    "HangWatch",
    "InjectedAt",
    "SlowWatch",
    "StackCaptures",
    "active_at",
    "chip_faults",
    "collective_fault",
    "exit_fault",
    "hang_fault",
    "hang_look",
    "heartbeat_due",
    "launcher_faults",
    "lost_nodes",
    "rank_active",
]

SILENT_NODE: Final = "silent"
"""How a node-lost fault's detail begins when the node fell silent rather than died."""

ACTIVE_CPU_SHARE: Final = 0.10
"""A silent rank whose processes used at least this share of one core since the last sample is
computing, not hung (R-25; MindCluster's detector counts a round as hung only under 5 s of CPU
in 60 s). A SIGSTOPped rank uses none, nor does one blocked in a gloo collective."""

InjectedAt = Callable[[tuple[str, str], float], float]
"""When a planned fault with this key was injected (and forget it), else the default: a fault
the plan caused is timed from its injection, not from when it was seen."""


@dataclass(frozen=True)
class Detected:
    fault: Fault
    source: str


@dataclass
class Capture:
    """A hang's stacks being captured before it is decided (controller.stacks)."""

    request: int
    found: Detected
    attempt: int
    began: float
    deadline: float
    waiting: set[int]
    """The pods whose launcher has not answered yet."""
    stacks: list[StackGroup] = field(default_factory=list)
    """As the launchers sent them (each launcher's alike stacks once), grouped across the pods
    when the capture is finished."""


@dataclass
class StackCaptures:
    """Stack capture's own state (controller.stacks): the capture under way, if any, and the
    number of the last request sent (an answer to an older one is dropped)."""

    current: Capture | None = None
    requests: int = 0

    @property
    def busy(self) -> bool:
        """A hang waits for its stacks before it is decided."""
        return self.current is not None


@dataclass
class SlowWatch:
    """The slow-pod check's own state (checks.slow): when it last compared the pods, and the
    pods found slow at every comparison since when."""

    checked_at: float = 0.0
    since: dict[int, float] = field(default_factory=dict)
    training: tuple[object, float] = (None, 0.0)
    """(the attempt and its pods' placements, since when every rank of them made progress):
    the pods are compared from a window after that."""


def exit_fault(
    link: LauncherLink, node: str, message: Exited, injected_at: InjectedAt
) -> Detected | None:
    """A rank exited non-zero (or by a signal) without being stopped (of any attempt: an exit of
    an attempt that ended may be the collateral of the fault that ended it)."""
    if message.code == 0 and not message.signal:
        return None
    fault = Fault(
        FaultKind.PROCESS_EXIT,
        injected_at(("exit", str(message.rank)), message.at),
        node=node,
        pod=link.pod,
        rank=message.rank,
        exit_code=message.code,
        signal=message.signal,
        detail=message.detail,
        error=message.error,
    )
    # a replacement (process level) reuses attempt, generation and rank: the exit time tells
    return Detected(fault, exit_source(message.attempt, link.generation, message.rank, message.at))


def exit_source(attempt: int, generation: int, rank: int, at: float | None = None) -> str:
    """The source of a rank's exit fault (one per exit: a repeat of it is not stored twice);
    without `at`, what every exit of that rank of that attempt and generation begins with."""
    head = f"exit:{attempt}:{generation}:{rank}:"
    return head if at is None else f"{head}{at:.6f}"


def chip_faults(beat: Heartbeat, pod: int | None, injected_at: InjectedAt) -> list[Detected]:
    """The chip and link faults a node's heartbeat reports (repeated until they heal)."""
    found = []
    for chip in beat.chips:
        kind = FaultKind.MEMORY_UCE if chip.kind == "memory-uce" else FaultKind.CHIP
        at = injected_at(("chip", beat.node), chip.at)
        fault = Fault(kind, at, node=beat.node, chip=chip.chip, pod=pod, code=chip.code)
        found.append(Detected(fault, f"{beat.node}:{chip.seq}"))
    link = beat.link
    if link is not None:
        at = injected_at(("net", beat.node), link.at)
        fault = Fault(
            FaultKind.NETWORK,
            at,
            node=beat.node,
            pod=pod,
            duration_s=link.duration_s,
            detail=link.cause,
        )
        found.append(Detected(fault, f"{beat.node}:{link.seq}"))
    return found


def corruption_fault(
    message: CorruptionFound, node_of: Callable[[int], tuple[int, str] | None], at: float
) -> Detected:
    """R-45: the replicas' fingerprints apart. The first rank the majority names is the culprit,
    on its pod and node (`node_of`: where a rank runs); none where no majority names one. Every
    rank says so: the step keys the fault, stored once."""
    culprit = message.culprits[0] if message.culprits else None
    where = node_of(culprit) if culprit is not None else None
    named = ", ".join(map(str, message.culprits)) or "none named by a majority"
    detail = (
        f"the replicas' parameters differ at step {message.step} (last agreed at step "
        f"{message.clean_step}); culprits: {named}; fingerprints: {', '.join(message.fingerprints)}"
    )
    fault = Fault(
        FaultKind.SILENT_CORRUPTION,
        at,
        node=where[1] if where else None,
        pod=where[0] if where else None,
        rank=culprit if where else None,
        step=message.step,
        detail=detail,
    )
    return Detected(fault, f"corruption:{message.attempt}:{message.step}")


def collective_fault(
    link: LauncherLink, message: CollectiveFailed, links_down: list[str], operator_retry: bool
) -> Detected | None:
    """A collective the SDK issued failed on its transport. It is a fault where relaunch acts on
    it: with operator retry on (R-29), or while a data link of the job is down (R-30: the group
    is formed anew once it is back; a blip's ranks whose collective timed out would otherwise
    wait for a group nobody re-forms). Else None: a symptom, whose cause (a rank that exited,
    hung, or was lost with its node) is decided where it is seen. The rank that says so may be
    the healthy end of the link: the node blamed is the one whose data link is down now, if
    one is. Every rank whose collective failed says so: one fault per collective and
    generation."""
    if not operator_retry and not links_down:
        return None
    node = links_down[0] if len(links_down) == 1 else None
    fault = Fault(
        FaultKind.COLLECTIVE,
        message.at,
        node=node,
        pod=link.pod if node is None or node == link.node else None,
        rank=message.rank,
        step=message.step,
        collective=message.collective,
        detail=message.why,
    )
    source = (
        f"collective:{message.attempt}:{message.generation}:{message.step}:{message.collective}"
    )
    return Detected(fault, source)


@dataclass(frozen=True)
class LostNode:
    node: str
    why: str
    silent_s: float
    detected: Detected


def lost_nodes(
    nodes: Iterable[NodeRow],
    agents: Mapping[str, AgentLink],
    gone: Mapping[str, str],
    now: float,
    timeout: float,
    silent_since: float,
    injected_at: InjectedAt,
) -> list[LostNode]:
    """Nodes in use whose agent is silent for `timeout`, or that the engine reports dead (`gone`:
    each with what the engine saw), whichever comes first. `silent_since`: when a node without a connected agent started
    counting (a resume counts from the end of its adoption)."""
    found = []
    for node in nodes:
        if node.state not in (NodeState.READY, NodeState.FAULTY):
            continue  # lost already, or isolated: no pod of the job goes there
        agent = agents.get(node.name)
        last = agent.last_heartbeat if agent is not None else silent_since
        if now - last > timeout or node.name in gone:
            silent = node.name not in gone
            seen = gone.get(node.name, "")
            why = (
                f"no heartbeat for {timeout:g} s"
                if silent
                else "the engine reports the node dead" + (f": {seen}" if seen else "")
            )
            at = injected_at(("node", node.name), last)
            # a silent node may still run (cut off): its pods' replacements wait (fencing)
            detail = f"{SILENT_NODE}: {why}" if silent else why
            fault = Fault(FaultKind.NODE_LOST, at, node=node.name, detail=detail)
            detected = Detected(fault, f"lost:{node.name}:{last:.3f}")
            found.append(LostNode(node.name, why, now - last, detected))
    return found


def heartbeat_due(
    nodes: Iterable[NodeRow], agents: Mapping[str, AgentLink], timeout: float, silent_since: float
) -> float | None:
    """The earliest moment `lost_nodes` could find a silent node, as things stand: a heartbeat
    only moves it later, so a controller that looks then misses no loss (None: no node in use)."""
    lasts = [
        agent.last_heartbeat if (agent := agents.get(node.name)) is not None else silent_since
        for node in nodes
        if node.state in (NodeState.READY, NodeState.FAULTY)
    ]
    return min(lasts) + timeout if lasts else None


def launcher_faults(
    pods: Iterable[Pod], nodes: Mapping[str, NodeRow], now: float, grace: float
) -> list[tuple[Pod, Detected]]:
    """A launcher whose connection closed and did not come back within `grace` while its node
    lives: the pod's container died."""
    found = []
    for pod in pods:
        if pod.phase is not PodPhase.LOST or pod.lost_since_moved or now - pod.since <= grace:
            continue
        node = nodes.get(pod.row.node)
        if node is None or node.state is NodeState.LOST:
            continue  # the node's loss is the fault
        fault = Fault(
            FaultKind.PROCESS_EXIT,
            pod.since,
            node=pod.row.node,
            pod=pod.index,
            signal=9,
            detail=LAUNCHER_DIED,
        )
        found.append(
            (pod, Detected(fault, f"launcher:{pod.index}:{pod.row.generation}:{pod.since:.3f}"))
        )
    return found


def rank_active(rank: Rank, cpu: float, io: int, now: float) -> bool:
    """A usage sample shows the rank alive: enough CPU since the last sample, or any I/O (R-25:
    ModelArts counts a process's I/O, MindCluster its CPU time; a rank writing a checkpoint is
    making progress). A rank that showed progress or output since the last sample is not
    sampled meanwhile (the launcher skips it): this sample is only the baseline for the next,
    its difference from the old one proves nothing about now."""
    if rank.usage is None:
        return False
    then, cpu_then, io_then = rank.usage
    if rank.last_activity > then:
        return False
    busy = cpu - cpu_then >= ACTIVE_CPU_SHARE * max(now - then, 1e-3)
    return busy or io > io_then


def active_at(
    rank: Rank, cpu: float, io: int, working: int, stopped: int, now: float
) -> float | None:
    """When a usage sample shows the rank last alive (None: it does not): now, if its looks
    found it working (or `rank_active`); but a rank also found stopped (SIGSTOP, a debugger)
    worked before it stopped, which the sample only places after the previous one: that
    sample's time (before, the first sample after a SIGSTOP counted the work of the moments
    before it as life at the sample, and the hang was found up to a sampling interval late)."""
    if not (working or rank_active(rank, cpu, io, now)):
        return None
    if not stopped:
        return now
    return rank.usage[0] if rank.usage is not None else None


@dataclass(frozen=True)
class HangLook:
    """What one look at the ranks found: a hang, or when the next look could find one."""

    found: Detected | None
    due: float | None
    """As things stand (no message since), the earliest moment a look could find a hang; None:
    never (no rank runs), or at once (a hang was found: its ranks' silence starts again)."""


def hang_fault(
    links: Iterable[LauncherLink],
    attempt: int,
    now: float,
    hang_s: float,
    startup_s: float,
    exempt: Callable[[int], bool],
    injected_at: InjectedAt,
    waited_until: float = 0.0,
) -> Detected | None:
    """R-25: a rank of the current attempt silent for the hang window (see `hang_look`)."""
    return hang_look(
        links, attempt, now, hang_s, startup_s, exempt, injected_at, waited_until
    ).found


def hang_look(
    links: Iterable[LauncherLink],
    attempt: int,
    now: float,
    hang_s: float,
    startup_s: float,
    exempt: Callable[[int], bool],
    injected_at: InjectedAt,
    waited_until: float = 0.0,
) -> HangLook:
    """R-25: a rank of the current attempt silent for the hang window (before its first sign of
    progress, or while the SDK says it builds its group and waits there for peers that still
    start: the startup allowance). When several are silent (one stuck rank stalls its peers
    at the next collective), the one silent longest is reported. `exempt` ranks (healthy ranks
    waiting for replacements) are not hung. A rank inside a checkpoint save (the SDK's phase)
    is making progress, for up to the startup allowance, and while one is, its silent peers
    are waiting for it in a collective: neither is hung, and the peers' silence counts from
    the end of the save. Ranks that waited for something outside them until `waited_until`
    are not hung either: their silence counts from then (the network: a node of the job whose
    data link was down, R-12's flap ridden out; or the attempt's last pod to start: ranks
    started before wait for it in their rendezvous)."""
    silent: list[tuple[float, LauncherLink, int, float]] = []
    current = [
        (link, index, rank)
        for link in links
        if not link.stopping
        for index, rank in link.ranks.items()
        if rank.running and rank.attempt == attempt
    ]
    saved_at = max((rank.save_ended_at for _, _, rank in current), default=0.0)
    save_counts = max(startup_s, hang_s)
    save_due: float | None = None  # the first save that stops counting as progress
    due: float | None = None
    for link, rank_index, rank in current:
        if exempt(rank_index):
            continue
        if rank.saving and now - rank.phase_since <= save_counts:
            ends = rank.phase_since + save_counts  # making progress, however slow the disk
            save_due = ends if save_due is None else min(save_due, ends)
            continue
        # before its first step, or in its rendezvous waiting for peers still starting
        window = hang_s if rank.progressed and not rank.forming else startup_s
        # it waited for a peer's save, the network or the last pod's start until then
        since = max(rank.last_activity, saved_at, waited_until)
        if now - since > window:
            silent.append((since, link, rank_index, window))
        elif due is None or since + window < due:
            due = since + window
    if save_due is not None:  # the silent ones wait for the saving rank in a collective
        return HangLook(None, save_due)
    if not silent:
        return HangLook(None, due)
    _, link, rank_index, window = min(silent, key=lambda item: item[0])
    at = injected_at(("hang", "job"), now - window)
    fault = Fault(
        FaultKind.HANG, at, pod=link.pod, rank=rank_index, detail=f"silent for {window:g} s"
    )
    return HangLook(Detected(fault, f"hang:{attempt}:{rank_index}:{now:.3f}"), None)


@dataclass
class HangWatch:
    """When the hang detector must look at the ranks again, so that a job of thousands of ranks
    is not scanned at every pass: the due time its last look gave, valid while the things the
    look depended on stay as they were (`key`: the attempt, the recovery under way, the
    network's wait). A message that could bring a hang earlier than the look said (a rank
    started, a first step, a phase, a launcher's hello) makes it look at the next pass: routine
    messages (steps of a rank that stepped before, usage, heartbeats) only push hangs later."""

    due: float | None = None
    key: object = None
    fresh: bool = False

    def stale(self) -> None:
        """Something changed that a look depends on: the next pass looks."""
        self.fresh = False

    def must_look(self, now: float, key: object) -> bool:
        return not self.fresh or key != self.key or (self.due is not None and now >= self.due)

    def looked(self, look: HangLook, key: object) -> None:
        self.due, self.key, self.fresh = look.due, key, look.found is None
