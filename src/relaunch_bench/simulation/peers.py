"""Simulated node agents and pod launchers: one process plays many of each, over the real wire.

Each simulated agent and launcher has its own TCP connection to the controller and speaks the
real protocol (protocol.messages over protocol.wire, doorbell included): an agent says hello,
beats at the cluster's interval, reports the chip faults a fault plan injects and heals them
when asked; a launcher says hello, "starts" the ranks it is told to (no process: a rank is a
step counter), reports their steps at the plan's progress interval and their usage at its
activity interval, stops them, exits a rank with a code or hangs it when a fault plan says so,
answers a stack capture, and keeps the membership it is sent. What a real launcher does with
processes (cgroups, signals, py-spy) is what this leaves out; what the controller hears and
sends is the same.

The engine (simulation.engine) sends this process requests as JSON lines on its standard input:
`agent`, `pod`, `kill` (a node lost: its agent and launchers close at once) and `shutdown`.

Steps: the job trains at `step_s` a step, on one clock for every rank (a synchronous job); a
rank started at attempt N takes `first_step_s` to its first step, then follows the clock. A job
of `steps` steps ends when the clock passes them: every rank exits 0.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import selectors
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from relaunch.diagnosis import Frame, RankStack, StackGroup, group_stacks
from relaunch.protocol.messages import (
    AgentHello,
    Assume,
    CaptureStacks,
    ChipReport,
    Exited,
    Heal,
    Healed,
    Heartbeat,
    InjectChipFault,
    Injected,
    InjectProcessFault,
    LauncherHello,
    Lease,
    MembershipUpdate,
    Message,
    Progress,
    ProgressBatch,
    Shutdown,
    Stacks,
    Start,
    Started,
    Stop,
    Stopped,
    Usage,
)
from relaunch.protocol.plans import LaunchPlan
from relaunch.protocol.wire import Connection, controller_address

__all__ = ["Shard", "main"]

FIRST_STEP_S = 0.05
"""How long a (re)started simulated rank takes to its first step."""


@dataclass
class SimRank:
    attempt: int
    started_at: float
    running: bool = True
    hung: bool = False
    last_step: int = -1


@dataclass
class SimAgent:
    node: str
    chips: int
    conn: Connection
    faults: dict[int, ChipReport] = field(default_factory=dict)
    seq: int = 0


@dataclass(frozen=True)
class SimPlan:
    """What a simulated launcher uses of its pod's launch plan (the engine sends only this:
    the whole plan, encoded and decoded for each of thousands of pods, cost the controller's
    process more than its own work)."""

    job: int
    pod: int
    generation: int
    node: str
    first_rank: int
    procs_per_pod: int
    progress_interval_s: float
    activity_interval_s: float
    standby: bool

    @classmethod
    def of(cls, plan: LaunchPlan) -> dict[str, object]:
        return {name: getattr(plan, name) for name in cls.__dataclass_fields__}

    @classmethod
    def from_plan(cls, plan: LaunchPlan) -> SimPlan:
        """What a standby launcher takes of the plan an `Assume` hands it."""
        return cls(**{name: getattr(plan, name) for name in cls.__dataclass_fields__})


@dataclass
class SimLauncher:
    plan: SimPlan
    conn: Connection
    attempt: int = 0
    ranks: dict[int, SimRank] = field(default_factory=dict)
    cpu: float = 0.0


class Shard:
    """Many agents and launchers in one process, one selector for all their connections."""

    def __init__(self, state_dir: Path, step_s: float, steps: int, origin: float) -> None:
        self.state_dir = state_dir
        self.step_s = step_s
        self.steps = steps
        self.origin = origin
        self.selector = selectors.DefaultSelector()
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.order = itertools.count()
        self.agents: dict[str, SimAgent] = {}
        self.launchers: dict[tuple[int, int, str], SimLauncher] = {}
        """By (pod, generation, node): a standby launcher is pod -1 on its node until it
        assumes a pod."""
        self.running = True
        self.pending = b""
        self.address: tuple[str, int] | None = None
        """The controller's, read once (each of thousands of peers reading the file cost the
        shard a third of a connection)."""
        self.received = 0
        self.sent = 0

    # -- time -----------------------------------------------------------------------------------

    def step_now(self, now: float) -> int:
        return max(0, int((now - self.origin) / self.step_s))

    def later(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (time.time() + delay, next(self.order), action))

    def every(self, interval: float, action: Callable[[], bool]) -> None:
        """`action` every `interval` (first after a random share of it) while it returns True."""
        offset = interval * (hash((id(action), time.time())) % 1000) / 1000

        def tick() -> None:
            if action():
                self.later(interval, tick)

        self.later(offset, tick)

    # -- connections ------------------------------------------------------------------------------

    def connect(self, hello: Message, on_message: Callable[[Message], None]) -> Connection | None:
        address = self.address
        for _ in range(100):  # the controller writes its address once it listens
            if address is not None:
                break
            address = controller_address(self.state_dir)
            time.sleep(0 if address is not None else 0.05)
        if address is None:
            return None
        try:
            conn = Connection.connect(*address, timeout=30)
        except OSError:
            self.address = None  # read again next time (one controller runs a simulation)
            raise
        self.address = address
        self.selector.register(conn.fileno(), selectors.EVENT_READ, (conn, on_message))
        self.send(conn, hello)
        return conn

    def send(self, conn: Connection, message: Message) -> None:
        if conn.send(message):
            self.sent += 1

    def close(self, conn: Connection) -> None:
        if not conn.closed:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn.fileno())
            conn.close()

    # -- agents ---------------------------------------------------------------------------------

    def start_agent(self, node: str, chips: int, interval: float) -> None:
        agent: SimAgent | None = None

        def on_message(message: Message) -> None:
            assert agent is not None
            self.agent_message(agent, message)

        conn = self.connect(AgentHello(node, chips), on_message)
        if conn is None:
            return
        agent = SimAgent(node, chips, conn)
        self.agents[node] = agent

        def beat() -> bool:
            if agent.conn.closed:
                return False
            self.send(agent.conn, Heartbeat(node, time.time(), tuple(agent.faults.values())))
            return True

        self.every(interval, beat)

    def agent_message(self, agent: SimAgent, message: Message) -> None:
        match message:
            case InjectChipFault(index=index, chip=chip, code=code, heals=heals, kind=kind):
                agent.seq += 1
                agent.faults[chip] = ChipReport(agent.seq, chip, code, heals, kind, time.time())
                self.send(agent.conn, Injected(index, True, "", time.time()))
                self.send(
                    agent.conn,
                    Heartbeat(agent.node, time.time(), tuple(agent.faults.values())),
                )
            case Heal(request=request):
                agent.faults = {c: f for c, f in agent.faults.items() if not f.heals}
                self.send(agent.conn, Healed(request, agent.node, not agent.faults))
                self.send(
                    agent.conn,
                    Heartbeat(agent.node, time.time(), tuple(agent.faults.values())),
                )
            case Shutdown():
                self.close(agent.conn)

    # -- launchers ------------------------------------------------------------------------------

    def start_pod(self, plan: SimPlan) -> None:
        launcher: SimLauncher | None = None

        def on_message(message: Message) -> None:
            assert launcher is not None
            self.launcher_message(launcher, message)

        hello = LauncherHello(
            plan.job, plan.pod, plan.generation, os.getpid(), 0, plan.node, plan.standby
        )
        conn = self.connect(hello, on_message)
        if conn is None:
            return
        launcher = SimLauncher(plan, conn)
        self.launchers[(plan.pod, plan.generation, plan.node)] = launcher
        if not plan.standby:  # a standby launcher waits, with its warm spares, to assume a pod
            self.watch(launcher)

    def watch(self, launcher: SimLauncher) -> None:
        """A pod's launcher forwards its ranks' steps and usage, as a real one does."""
        plan = launcher.plan
        self.every(plan.progress_interval_s, lambda: self.report(launcher))
        self.every(plan.activity_interval_s, lambda: self.usage(launcher))

    def assume(self, launcher: SimLauncher, plan: SimPlan) -> None:
        """A standby launcher becomes the pod's launcher (its spares the pod's processes at the
        next start), on the connection it has."""
        self.launchers.pop((launcher.plan.pod, launcher.plan.generation, launcher.plan.node), None)
        launcher.plan = plan
        self.launchers[(plan.pod, plan.generation, plan.node)] = launcher
        self.watch(launcher)

    def launcher_message(self, launcher: SimLauncher, message: Message) -> None:
        now = time.time()
        conn = launcher.conn
        match message:
            case Start(attempt=attempt, ranks=ranks):
                launcher.attempt = attempt
                first = launcher.plan.first_rank
                pids = {}
                for rank in range(first, first + launcher.plan.procs_per_pod):
                    if ranks is not None and rank not in ranks:
                        continue
                    old = launcher.ranks.get(rank)
                    if old is not None and old.running and old.attempt == attempt:
                        continue
                    launcher.ranks[rank] = SimRank(attempt, now)
                    pids[rank] = 100_000 + rank
                if pids:
                    self.send(conn, Started(attempt, now, pids))
                self.later(FIRST_STEP_S, lambda: self.first_steps(launcher))
            case Stop(ranks=ranks):
                ended = self.stop(launcher, ranks)
                self.send(conn, Stopped(launcher.attempt, time.time(), exited=ended))
            case InjectProcessFault(index=index, kind=kind, rank=rank, exit_code=exit_code):
                self.inject(launcher, index, kind, rank, exit_code)
            case CaptureStacks(request=request):
                self.send(conn, Stacks(request, launcher.attempt, self.stacks(launcher)))
            case MembershipUpdate():
                pass  # a real launcher writes it for the SDK; nothing reads it here
            case Assume(plan=plan):
                self.assume(launcher, SimPlan.from_plan(plan))
            case Shutdown():
                self.stop(launcher, None)
                self.close(conn)  # as a launcher answers a shutdown: by its close
            case Lease():
                pass

    def stop(
        self, launcher: SimLauncher, ranks: tuple[int, ...] | None
    ) -> dict[int, tuple[int, int | None, int | None]]:
        """The ranks stopped, as a Stopped tells them (ended by SIGTERM)."""
        ended: dict[int, tuple[int, int | None, int | None]] = {}
        for rank, sim in launcher.ranks.items():
            if sim.running and (ranks is None or rank in ranks):
                sim.running = False
                ended[rank] = (sim.attempt, None, 15)
        return ended

    def inject(
        self, launcher: SimLauncher, index: int, kind: str, rank: int, exit_code: int
    ) -> None:
        sim = launcher.ranks.get(rank)
        now = time.time()
        if sim is None or not sim.running:
            self.send(launcher.conn, Injected(index, False, f"rank {rank} is not running", now))
            return
        self.send(launcher.conn, Injected(index, True, "", now))
        if kind == "exit":
            sim.running = False
            self.send(launcher.conn, Exited(rank, sim.attempt, exit_code, None, now))
        elif kind == "hang":
            sim.hung = True

    def stacks(self, launcher: SimLauncher) -> tuple[StackGroup, ...]:
        """As a launcher says them: alike stacks once (its waiting ranks are alike)."""
        frames = (Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2500),)
        return group_stacks(
            RankStack(rank, 100_000 + rank, "stopped" if sim.hung else "sleeping", frames)
            for rank, sim in launcher.ranks.items()
            if sim.running
        )

    def first_steps(self, launcher: SimLauncher) -> None:
        """A restarted rank's first step goes at once (as the SDK's first step is urgent)."""
        self.report(launcher, only_new=True)

    def report(self, launcher: SimLauncher, only_new: bool = False) -> bool:
        if launcher.conn.closed:
            return False
        now = time.time()
        step = self.step_now(now)
        reports = []
        for rank, sim in launcher.ranks.items():
            if not sim.running or sim.hung or now - sim.started_at < FIRST_STEP_S:
                continue
            if only_new and sim.last_step >= 0:
                continue
            if step >= self.steps:
                sim.running = False
                self.send(launcher.conn, Exited(rank, sim.attempt, 0, None, now))
                continue
            if step != sim.last_step:
                sim.last_step = step
                reports.append(Progress(rank, step, sim.attempt, now))
        if reports:
            self.send(launcher.conn, ProgressBatch(tuple(reports)))
        return True

    def usage(self, launcher: SimLauncher) -> bool:
        if launcher.conn.closed:
            return False
        launcher.cpu += launcher.plan.activity_interval_s
        ranks = {
            rank: (launcher.cpu, 0)
            for rank, sim in launcher.ranks.items()
            if sim.running and not sim.hung and sim.attempt == launcher.attempt
        }
        if ranks:
            self.send(launcher.conn, Usage(launcher.attempt, time.time(), ranks))
        return True

    # -- requests from the engine -----------------------------------------------------------------

    def request(self, line: bytes) -> None:
        data = json.loads(line)
        op = data["op"]
        if op == "agent":
            self.start_agent(data["node"], data["chips"], data["interval"])
        elif op == "pod":
            self.start_pod(SimPlan(**data["plan"]))
        elif op == "kill":
            self.kill_node(data["node"])
        elif op == "shutdown":
            self.running = False

    def kill_node(self, node: str) -> None:
        agent = self.agents.pop(node, None)
        if agent is not None:
            self.close(agent.conn)
        for key, launcher in list(self.launchers.items()):
            if launcher.plan.node == node:
                self.close(launcher.conn)
                del self.launchers[key]

    def read_requests(self) -> None:
        data = os.read(sys.stdin.fileno(), 1 << 16)
        if not data:
            self.running = False
            return
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            if line.strip():
                self.request(line)

    def run(self) -> None:
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
        while self.running:
            now = time.time()
            while self.timers and self.timers[0][0] <= now:
                _, _, action = heapq.heappop(self.timers)
                action()
            wait = max(0.0, self.timers[0][0] - time.time()) if self.timers else 0.5
            for key, _ in self.selector.select(min(wait, 0.5)):
                if key.data is None:
                    self.read_requests()
                    continue
                conn, on_message = key.data
                messages = conn.read_ready()
                if messages is None:
                    self.close(conn)
                    continue
                self.received += len(messages)
                for message in messages:
                    on_message(message)
        for agent in self.agents.values():
            self.close(agent.conn)
        for launcher in self.launchers.values():
            self.close(launcher.conn)


def main() -> None:
    """`python -m relaunch_bench.simulation.peers STATE_DIR STEP_S STEPS ORIGIN`."""
    state_dir, step_s, steps, origin = sys.argv[1:5]
    Shard(Path(state_dir), float(step_s), int(steps), float(origin)).run()


if __name__ == "__main__":
    main()
