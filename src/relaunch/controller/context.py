"""The controller as its parts see it: the state they share and what each part offers the others.

The parts (checks, dispatch, commands, actions, the recovery driver, membership, the reconciler,
the fault plan, fencing, stack capture, the lifecycle) are written against `ControllerContext`,
not against `core.Controller`, which implements it. So the dependencies run one way:

    leaves (clock, peers, pods, detectors, pacer, listener, active) <── context <── parts <── core

and no part needs the module that assembles them (mypy checks that `Controller` is a
`ControllerContext` wherever core hands itself to a part). What one part asks of another is
declared here as a narrow protocol (`Recoveries`, `MembershipView`, ...), the part's own class
implementing it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from relaunch.cluster import Engine
from relaunch.cluster.config import ClusterConfig
from relaunch.controller.active import ActiveRecovery
from relaunch.controller.clock import Clock
from relaunch.controller.detectors import HangWatch, SlowWatch, StackCaptures
from relaunch.controller.listener import Listener
from relaunch.controller.pacer import Adoption, Pacer
from relaunch.controller.peers import AgentLink, LauncherLink, Peer
from relaunch.controller.pods import Pod
from relaunch.events import EventKind
from relaunch.faults import DEFAULT_TABLE, EscalationRules, Fault, FaultCodeTable
from relaunch.protocol.layout import StateDir
from relaunch.protocol.messages import Injected
from relaunch.protocol.plans import Membership
from relaunch.spec import JobSpec
from relaunch.spec.settings import RecoverySettings
from relaunch.states import StopCause
from relaunch.store import JobRow, JobStatus, NodeRow, PodRow, RecordRow, Store

__all__ = [
    "ControllerContext",
    "FaultPlanView",
    "InjectionKey",
    "Leases",
    "MembershipView",
    "Recoveries",
    "RunOptions",
    "Standby",
    "TrainingProgress",
]

InjectionKey = tuple[str, str]
"""What detects a planned fault (its detector and the rank or node), to time it from injection."""


@dataclass
class RunOptions:
    startup_s: float | None = None
    """Allowance before the first sign of progress after a (re)start; overrides the job's
    spec.startup_seconds (default max(2 x hang window, 60 s))."""
    table: FaultCodeTable = DEFAULT_TABLE
    rules: EscalationRules = field(default_factory=EscalationRules)
    resume: bool = False
    resumed_from: StopCause | None = None
    """A resume of a job stopped to be resumed (`StopCause.resumable`: its terminal's hangup,
    or for want of nodes): its pods and agents were stopped with it, so the job is rebuilt from
    its checkpoints as after an outage longer than the adopt grace: relaunch's own, no restart
    spent. None: a resume of a job whose controller died."""


@dataclass
class TrainingProgress:
    """The newest step any rank reported, and whether the job reports steps at all."""

    step: int | None = None
    uses_sdk: bool = False
    saved_at: float = 0.0


class Recoveries(Protocol):
    """The recovery driver (controller.recovery): faults in, the one recovery under way."""

    active: ActiveRecovery | None
    waiting: bool
    hang_stop: bool
    waited_until: float

    def fault(
        self,
        fault: Fault,
        source: str,
        attempt: int | None = None,
        started_at: float = 0.0,
        evidence: Mapping[str, Any] | None = None,
        detected_at: float | None = None,
    ) -> None: ...

    def collateral(self, fault: Fault, source: str, attempt: int, started_at: float) -> bool: ...

    def failed(self, why: str) -> None: ...

    def carry_on(self, active: ActiveRecovery) -> None: ...

    def save(self, active: ActiveRecovery) -> None: ...

    def resume(self, records: list[RecordRow]) -> None: ...

    def next_heal_request(self) -> int: ...

    def succeeded(self, now: float, resumed_at: float | None = None) -> None: ...

    def progressed(
        self,
        rank: int,
        started_at: float,
        attempt: int,
        step: int | None,
        reported_at: float | None = None,
    ) -> None: ...

    def healed(self, request: int, ok: bool) -> None: ...


class MembershipView(Protocol):
    """The group's membership (controller.membership)."""

    joining: tuple[int, ...]
    joining_until: float

    def current(self) -> Membership | None: ...

    def parked(self) -> set[int]: ...

    def publish(
        self,
        joiners: tuple[int, ...] = (),
        retry: bool = False,
        parked: set[int] | None = None,
        reform: bool = False,
        operator: tuple[int, int, int] | None = None,
        suspects: tuple[int, ...] = (),
    ) -> int: ...

    def joined(self, rank: int) -> None: ...


class Standby(Protocol):
    """The reconciler's standby launchers (controller.reconcile), one per node that keeps one,
    and when the attempt's last pod got its start."""

    standby: dict[str, LauncherLink]

    def standby_hello(self, link: LauncherLink) -> bool: ...

    def started_everywhere(self, attempt: int) -> float | None: ...

    def connected(self, pod: Pod) -> None: ...


class FaultPlanView(Protocol):
    """The fault plan being carried out (controller.faultplan)."""

    def injected_at(self, key: InjectionKey, default: float) -> float: ...

    def reload(self, stored: list[dict[str, object]]) -> None: ...

    def acknowledged(self, message: Injected) -> None: ...

    def at_end(self, job: JobRow) -> None: ...


class Leases(Protocol):
    """The launchers' leases (controller.fencing)."""

    def fence_until(self, fault: Fault) -> float | None: ...

    def hold_until(self) -> float | None: ...


class ControllerContext(Protocol):
    """What the parts of the controller share: the job's configuration, the state observed and
    desired, and the other parts. `core.Controller` is the one implementation."""

    store: Store
    engine: Engine
    layout: StateDir
    cluster: ClusterConfig
    job_id: int
    spec: JobSpec
    recovery: RecoverySettings
    options: RunOptions
    clock: Clock
    hang_s: float
    startup_s: float
    on_output: Callable[[int, int, str], None] | None

    job: JobRow
    ended_copies: tuple[tuple[str, int], ...]
    """Other jobs' copies on the nodes' disks, for each agent that joins to remove its node's
    (lifecycle.ended_jobs_copies)."""
    nodes: dict[str, NodeRow]
    pods: dict[int, Pod]
    agents: dict[str, AgentLink]
    links: dict[int, LauncherLink]
    listener: Listener | None
    caught_up_at: float
    progress: TrainingProgress
    adoption: Adoption
    pacer: Pacer

    capture: StackCaptures
    hang_watch: HangWatch
    slow: SlowWatch

    @property
    def recoveries(self) -> Recoveries: ...

    @property
    def membership(self) -> MembershipView: ...

    @property
    def reconciler(self) -> Standby: ...

    @property
    def fault_plan(self) -> FaultPlanView: ...

    @property
    def leases(self) -> Leases: ...

    def event(self, kind: EventKind, **fields: Any) -> None: ...

    def update_job(self, **fields: object) -> None: ...

    def move_job(
        self, to: JobStatus, *, reason: str = "", cause: StopCause | None = None, **fields: object
    ) -> None: ...

    def put_pod(self, row: PodRow) -> None: ...

    def put_pods(self, rows: list[PodRow]) -> None: ...

    def refresh_nodes(self) -> None: ...

    def refresh_node(self, name: str) -> None: ...

    def node(self, name: str) -> NodeRow | None: ...

    def ranks_of(self, pod: int) -> tuple[int, ...]: ...

    def launcher_of(self, peer: Peer, leaving: bool = False) -> LauncherLink | None: ...

    def linked(self, link: LauncherLink) -> None: ...

    def hurry(self) -> None: ...

    def drain(self, wait: float) -> None: ...

    def step(self, wait: float = 0.0) -> None: ...
