"""A controller driven by hand: a real store (SQLite in a temporary directory), a fake engine, a
fake clock and fake peers standing in for node agents and pod launchers. Nothing starts a process
or opens a socket; a test plays the agents and launchers by sending their messages, steps the
controller, and reads what it sent and stored."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaunch import runner
from relaunch.cluster import NOTHING_COUNTED, EngineBase, EngineFacts, LeftBehind, Rehearsal
from relaunch.cluster.config import ClusterConfig, NodeSpec
from relaunch.controller import Controller, RunOptions, lifecycle
from relaunch.controller.clock import TICK_S
from relaunch.diagnosis import Frame, RankStack, group_stacks
from relaunch.events import Event, EventKind
from relaunch.faults.plan import parse_plan
from relaunch.protocol.messages import (
    AgentHello,
    CaptureStacks,
    ChipReport,
    Exited,
    Heal,
    Healed,
    Heartbeat,
    LauncherHello,
    LinkReport,
    Message,
    ProcReport,
    Progress,
    ProgressBatch,
    Shutdown,
    Stacks,
    Start,
    Started,
    Stop,
    Stopped,
)
from relaunch.protocol.plans import LaunchPlan
from relaunch.spec import parse_job
from relaunch.store import JobStatus, RecordRow, Store


class FakeClock:
    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class FakePeer:
    name: str
    wire: list[tuple[str, Message]] = field(default_factory=list)
    """Every message sent to any peer of the simulation, in order (shared between peers)."""
    sent: list[Message] = field(default_factory=list)
    closed: bool = False
    closes_on_shutdown: bool = False
    """Closes its connection as soon as it is told to shut down (as a launcher's does once its
    processes are gone), without waiting for the next tick."""

    def send(self, message: Message) -> bool:
        if self.closed:
            return False
        self.sent.append(message)
        self.wire.append((self.name, message))
        if self.closes_on_shutdown and isinstance(message, Shutdown):
            self.closed = True
        return True

    def of(self, kind: type[Message]) -> list[Any]:
        return [m for m in self.sent if isinstance(m, kind)]


def waiting_stack(rank: int, state: str = "sleeping") -> RankStack:
    frames = (
        Frame("wait", "site-packages/torch/distributed/distributed_c10d.py", 3252),
        Frame("all_reduce", "site-packages/torch/distributed/distributed_c10d.py", 3250),
        Frame("main", "train.py", 40),
    )
    return RankStack(rank, 5000 + rank, state, frames, "\n".join(map(str, frames)))


class FakeEngine(EngineBase):
    facts = EngineFacts(
        chips="chips are simulated", containers="pods are simulated", networks="nodes are simulated"
    )

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.plans: list[LaunchPlan] = []
        """Every pod's launch plan, in the order the launchers were started."""
        self.dead: set[str] = set()

    @property
    def rehearsal(self) -> Rehearsal:
        return self

    def start_agent(self, node: NodeSpec, interval: float, grace: float, blip_s: float) -> int:
        self.calls.append(("start_agent", node.name))
        return 1

    def start_pod(self, plan: LaunchPlan) -> int:
        self.calls.append(("start_pod", plan.pod, plan.generation, plan.node))
        self.plans.append(plan)
        return 1

    def assumed(self, job: int, node: str, pod: int, generation: int) -> None:
        self.calls.append(("assumed", node, pod, generation))

    def kill_node(self, node: str) -> None:
        self.calls.append(("kill_node", node))

    def shutdown(self) -> LeftBehind:
        self.calls.append(("shutdown",))
        return NOTHING_COUNTED

    def lost_nodes(self) -> dict[str, str]:
        return dict.fromkeys(self.dead, "its agent exited")

    def free_port(self, node: str) -> int:
        return 29500

    def inject_link_fault(
        self, node: str, kind: Any, duration_s: Any, cut: Any = None, rate_mbit: Any = None
    ) -> str | None:
        self.calls.append(("inject_link_fault", node, kind, duration_s, cut, rate_mbit))
        return "simulated nodes have no links"

    def pods_started(self) -> list[tuple[int, int, str]]:
        return [(c[1], c[2], c[3]) for c in self.calls if c[0] == "start_pod"]


RETRY_8 = {"fault-tolerance/job-retry-num": "8", "fault-tolerance/job-unconditional-retry": "true"}
MINDCLUSTER = {"process-recover-enable": "on", "pod-rescheduling": "on"}

LADDERS: dict[str, tuple[dict[str, str], dict[str, str], dict[str, Any]]] = {
    "plain": (RETRY_8, {}, {}),
    "process-level": (
        {**RETRY_8, "recover-strategy": "retry,recover-in-place,recover,dump,exit"},
        MINDCLUSTER,
        {},
    ),
    "elastic": (
        {
            **RETRY_8,
            "recover-strategy": "retry,recover-in-place,recover,elastic-training,dump,exit",
        },
        MINDCLUSTER,
        {},
    ),
    "warm-spares": (
        {**RETRY_8, "recover-strategy": "retry,recover-in-place,recover,dump,exit"},
        MINDCLUSTER,
        {"warm_spares": 1},
    ),
}
"""The ladders a rule must hold on: (annotations, labels, spec) of a job of each."""


def job_spec(
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    replicas: int = 2,
    procs_per_pod: int = 2,
    **spec: Any,
) -> dict[str, Any]:
    return {
        "kind": "job",
        "metadata": {
            "name": "sim",
            "annotations": annotations or {},
            "labels": {"fault-scheduling": "grace", "grace-over-time": "3", **(labels or {})},
        },
        "spec": {
            "replicas": replicas,
            "procs_per_pod": procs_per_pod,
            "chips_per_pod": 2,
            "command": "python train.py",
            "hang_detect_seconds": 2,
            "startup_seconds": 10,
            **spec,
        },
    }


class Sim:
    """One job on a fake cluster of `nodes` nodes of 2 chips."""

    def __init__(
        self,
        tmp: Path,
        job: dict[str, Any],
        nodes: int = 4,
        plan: list[dict[str, Any]] | None = None,
        heal_delay_s: float = 0.0,
    ) -> None:
        self.tmp, self.plan = tmp, plan
        self.clock = FakeClock()
        self.engine = FakeEngine()
        self.cluster = ClusterConfig.sized(
            nodes, 2, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, adopt_grace_s=3.0
        )
        self.store = Store(tmp / "relaunch.db")
        self.store.ensure_nodes([(n.name, n.chips) for n in self.cluster.nodes])
        spec = parse_job(job)
        self.job_id = self.store.create_job(
            spec.name, {"raw": job, "source": "sim"}, plan or [], self.clock.now()
        )
        self.store.claim_job(self.job_id, self.clock.now())
        runner.create_pods(self.store, tmp, self.job_id, spec)
        self.events: list[Event] = []
        """What the controller recorded, in order (the store holds the same)."""
        self.controller = Controller(
            self.store,
            self.engine,  # type: ignore[arg-type]
            tmp,
            self.cluster,
            self.job_id,
            spec,
            parse_plan(plan or []),
            RunOptions(),
            on_event=self.events.append,
            clock=self.clock,
        )
        self.agents: dict[str, FakePeer] = {}
        self.silent: set[str] = set()
        """Nodes whose agent no longer sends heartbeats."""
        self.links_down: set[str] = set()
        """Nodes whose agents say their data link is down."""
        self.link_reports: dict[str, LinkReport] = {}
        """What each node's agent says of its data link's last outage, in every heartbeat (as
        an agent repeats it): a flap's end carries its length."""
        self.link_rtt_ms: dict[str, float] = {}
        """Each node's data-link round trip, as its heartbeats say (none: not measured)."""
        self.launchers: dict[tuple[int, int], FakePeer] = {}
        """(pod, generation) -> the launcher that runs it."""
        self.procs: dict[tuple[int, int], dict[int, int]] = {}
        """(pod, generation) -> the ranks its launcher started, rank -> attempt (as the
        launcher knows them, whatever the controller heard yet)."""
        self.answered: set[tuple[int, int]] = set()
        """(peer, message) answered already, by identity: one message may go to many peers."""
        self.wire: list[tuple[str, Message]] = []
        """Every message the controller sent, to whom, in order."""
        self.heal_delay_s = heal_delay_s
        self.pending_heals: list[tuple[float, FakePeer, int]] = []
        self.chip_faults: dict[str, list[ChipReport]] = {}
        self.seq = 0
        self.stacks: dict[int, RankStack] = {}
        """What a launcher answers for a rank when asked for its stack (default: waiting in an
        all-reduce)."""
        self.mute_stacks: set[int] = set()
        """Pods whose launcher never answers a stack capture."""
        self.starting: set[int] = set()
        """Pods whose launcher has not started the ranks it was told to yet (a rank template
        still importing): its Start is answered once the pod leaves this set."""

    # -- driving -----------------------------------------------------------------------------------

    def boot(self) -> None:
        """As lifecycle.run does, without sockets: agents connect, the job runs, pods start."""
        c = self.controller
        for spec in self.cluster.nodes:
            # exits at its Shutdown, as an agent does
            peer = FakePeer(f"agent-{spec.name}", self.wire, closes_on_shutdown=True)
            self.agents[spec.name] = peer
            c.receive(peer, AgentHello(spec.name, spec.chips))
        c.drain(0)
        c.move_job(JobStatus.RUNNING, attempt_started_at=self.clock.now(), master_port=29500)
        c.membership.publish()
        self.run(0.5)

    def tick(self, dt: float = TICK_S) -> None:
        """Time passes; agents beat; launchers answer; heals come back; one controller step."""
        self.clock.t += dt
        c = self.controller
        for node, peer in self.agents.items():
            if node not in self.silent and node not in self.engine.dead:
                chips = tuple(self.chip_faults.get(node, ()))
                down = node in self.links_down
                rtt = self.link_rtt_ms.get(node)
                link = self.link_reports.get(node)
                beat = Heartbeat(
                    node, self.clock.now(), chips, link, link_down=down, data_rtt_ms=rtt
                )
                c.receive(peer, beat)
        self._launch()
        self._answer()
        c.step()

    def run(self, seconds: float) -> None:
        end = self.clock.now() + seconds
        while self.clock.now() < end:
            self.tick()

    def _launch(self) -> None:
        """Every launcher the engine was asked for says hello (none on a dead node, nor on a
        silent one: cut off, it cannot reach the controller)."""
        for pod, generation, node in self.engine.pods_started():
            if (pod, generation) in self.launchers or node in self.engine.dead | self.silent:
                continue
            peer = FakePeer(f"launcher-{pod}-g{generation}", self.wire)
            self.launchers[(pod, generation)] = peer
            hello = LauncherHello(
                self.job_id, pod, generation, 1000 + pod * 10 + generation, 0, node
            )
            self.controller.receive(peer, hello)

    def _answer(self) -> None:
        """Launchers start ranks when told, and say when a stop is done; agents answer heals."""
        c = self.controller
        ppp = c.spec.procs_per_pod
        for (pod, gen), peer in self.launchers.items():
            for message in list(peer.sent):
                key = (id(peer), id(message))
                if key in self.answered or (isinstance(message, Start) and pod in self.starting):
                    continue
                self.answered.add(key)
                if isinstance(message, Start):
                    # as the launcher does: a rank whose process still runs is not started
                    # again (a Start that overtook the answer to the one before it)
                    ranks = message.ranks or tuple(range(pod * ppp, pod * ppp + ppp))
                    running = self.running(pod, gen)
                    pids = {rank: 5000 + rank for rank in ranks if rank not in running}
                    self.procs.setdefault((pod, gen), {}).update(
                        dict.fromkeys(pids, message.attempt)
                    )
                    if pids:
                        c.receive(peer, Started(message.attempt, self.clock.now(), pids))
                elif isinstance(message, CaptureStacks) and pod not in self.mute_stacks:
                    link = c.pods[pod].link
                    running = [r for r, o in (link.ranks.items() if link else []) if o.running]
                    stacks = group_stacks(self.stacks.get(r, waiting_stack(r)) for r in running)
                    c.receive(peer, Stacks(message.request, c.job.attempt, stacks))
                elif isinstance(message, Shutdown):
                    peer.closed = True  # the launcher stops its processes and exits
                    c.receive(peer, None)
                elif isinstance(message, Stop):
                    link = c.pods[pod].link
                    ended = {
                        rank: (observed.attempt, None, 15)
                        for rank, observed in (link.ranks.items() if link else [])
                        if observed.running and (message.ranks is None or rank in message.ranks)
                    }
                    for rank, attempt in self.running(pod, gen).items():  # not heard yet
                        if message.ranks is None or rank in message.ranks:
                            ended.setdefault(rank, (attempt, None, 15))
                    table = self.procs.get((pod, gen), {})
                    for rank in ended:
                        table.pop(rank, None)
                    c.receive(peer, Stopped(c.job.attempt, self.clock.now(), exited=ended))
        for peer in self.agents.values():
            for message in peer.sent:
                if isinstance(message, Heal) and (id(peer), id(message)) not in self.answered:
                    self.answered.add((id(peer), id(message)))
                    self.pending_heals.append(
                        (self.clock.now() + self.heal_delay_s, peer, message.request)
                    )
        for due, peer, request in list(self.pending_heals):
            if self.clock.now() >= due:
                self.pending_heals.remove((due, peer, request))
                node = peer.name.removeprefix("agent-").removesuffix("-again")
                ok = all(f.heals for f in self.chip_faults.get(node, ()))
                self.chip_faults[node] = [f for f in self.chip_faults.get(node, ()) if not f.heals]
                c.receive(peer, Healed(request, node, ok))

    def running(self, pod: int, generation: int) -> dict[int, int]:
        """The ranks the launcher of (pod, generation) runs, rank -> attempt: those it started
        and did not stop, less those the controller heard end (a test's Exited)."""
        link = self.controller.pods[pod].link
        heard = link.ranks if link is not None and link.generation == generation else {}
        return {
            rank: attempt
            for rank, attempt in self.procs.get((pod, generation), {}).items()
            if not (rank in heard and heard[rank].attempt >= attempt and not heard[rank].running)
        }

    def finish(self) -> None:
        """The job ended: the controller's last act (lifecycle.finish), launchers closing as soon
        as they are told to shut down."""
        for peer in self.launchers.values():
            peer.closes_on_shutdown = True
        lifecycle.finish(self.controller, self.controller.job)

    def restart_controller(self) -> None:
        """The controller died (a test makes it stop where it likes) and `relaunch run --resume`
        starts a new one on the same store: the agents and every pod's launcher connect to it
        again, each launcher saying what its ranks are doing. The adoption window then runs."""
        old = self.controller
        spec = old.spec
        self.controller = Controller(
            self.store,
            self.engine,  # type: ignore[arg-type]
            self.tmp,
            self.cluster,
            self.job_id,
            spec,
            parse_plan(self.plan or []),
            RunOptions(resume=True),
            on_event=self.events.append,
            clock=self.clock,
        )
        c = self.controller
        self.pending_heals = []  # answers on the dead controller's connections are lost
        lifecycle.resume(c, self.clock.now())
        for node in list(self.agents):
            if node in self.engine.dead:
                continue
            peer = FakePeer(f"agent-{node}-again", self.wire, closes_on_shutdown=True)
            self.agents[node] = peer
            c.receive(peer, AgentHello(node, 2))
        for index, pod in old.pods.items():
            link = pod.link
            if link is None:
                continue
            procs = {
                rank: ProcReport(r.attempt, 5000 + rank, r.running, r.code, progressed=True)
                for rank, r in link.ranks.items()
            }
            # a Start the dead controller sent and the launcher got, but whose answer it never
            # heard: the launcher's ranks of that attempt run all the same
            for name, message in self.wire:
                if name == link.peer.name and isinstance(message, Start):
                    for rank in message.ranks or old.ranks_of(index):
                        if rank not in procs or procs[rank].attempt < message.attempt:
                            procs[rank] = ProcReport(message.attempt, 6000 + rank, True, None)
            peer = FakePeer(f"launcher-{index}-g{link.generation}-again", self.wire)
            self.launchers[(index, link.generation)] = peer
            hello = LauncherHello(
                self.job_id, index, link.generation, 1000 + index, link.started_attempt,
                pod.row.node, procs=procs,
            )  # fmt: skip  # the attempt it last started, as a real launcher says
            c.receive(peer, hello)

    # -- the job's side ----------------------------------------------------------------------------

    def link_peer(self, pod: int) -> FakePeer:
        row = self.controller.pods[pod].row
        return self.launchers[(pod, row.generation)]

    def train(self, step: int, pods: set[int] | None = None) -> None:
        """Every running rank of the current attempt (in `pods`, all when None) reports `step`."""
        c = self.controller
        for pod in c.pods.values():
            if pod.link is None or (pods is not None and pod.index not in pods):
                continue
            reports = tuple(
                Progress(rank, step, r.attempt, self.clock.now())
                for rank, r in pod.link.ranks.items()
                if r.running and r.attempt == c.job.attempt
            )
            if reports:
                c.receive(pod.link.peer, ProgressBatch(reports))  # type: ignore[arg-type]

    def kill_node(self, node: str) -> None:
        """The node dies: the engine knows it, its agent falls silent, its launchers vanish."""
        self.engine.dead.add(node)
        c = self.controller
        for pod in c.pods.values():
            if pod.row.node == node and pod.link is not None:
                peer = self.launchers[(pod.index, pod.row.generation)]
                peer.closed = True
                c.receive(peer, None)

    def crash(self, rank: int, code: int = 1) -> None:
        c = self.controller
        pod = rank // c.spec.procs_per_pod
        c.receive(self.link_peer(pod), Exited(rank, c.job.attempt, code, None, self.clock.now()))

    def chip_fault(self, node: str, chip: int, code: str, heals: bool = True) -> None:
        self.seq += 1
        report = ChipReport(self.seq, chip, code, heals, "chip", self.clock.now())
        self.chip_faults.setdefault(node, []).append(report)

    # -- reading -----------------------------------------------------------------------------------

    def said(self, kind: EventKind) -> list[Event]:
        """The events of `kind` the controller recorded, in order."""
        return [event for event in self.events if event.kind is kind]

    def kinds(self) -> list[EventKind]:
        """The kinds of the events the controller recorded, in order."""
        return [event.kind for event in self.events]

    def records(self) -> list[RecordRow]:
        return self.store.records(self.job_id)

    def actions(self) -> list[tuple[str, str]]:
        return [(r.action.value, r.outcome.value) for r in self.records()]
