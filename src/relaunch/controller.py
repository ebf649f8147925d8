"""The controller: the one loop that turns observations into faults, faults into decisions, and
decisions into actions, and writes down everything it does.

Level-triggered, as a Kubernetes controller: the store holds the desired state (every pod's node,
generation and counters; the job's attempt); each pass compares what agents and launchers report
with it and converges. A decision changes the desired state in one transaction with its record,
so that a controller killed at any point and started again on the same state directory carries on
without losing or repeating anything.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relaunch import failpoints
from relaunch.chaos import ChaosEntry, ChaosKind, parse_plan
from relaunch.cluster import Engine
from relaunch.cluster.config import ClusterConfig
from relaunch.faults import DEFAULT_TABLE, EscalationRules, Fault, FaultCodeTable, FaultKind
from relaunch.launcher import LaunchPlan
from relaunch.policy import Action, ClusterView, Decision, PodView, decide
from relaunch.spec import JobSpec, process_recovery_env
from relaunch.store import JobRow, JobStatus, NodeRow, NodeState, Outcome, PodRow, Store
from relaunch.train.checkpoint import FENCE_FILE
from relaunch.wire import Connection, write_controller_address

__all__ = ["Controller", "RunOptions"]

JOB_LEVEL = (Action.ISOLATED_JOB_RESCHEDULE, Action.JOB_RESCHEDULE)
FAILED_AT_START_S = 5.0


TICK_S = 0.05
"""How often the controller's checks run (heartbeats, hangs, fault plan, reconcile)."""
ACTIVE_CPU_SHARE = 0.10
"""A silent rank whose processes used at least this share of one core since the last sample is
computing, not hung (R-25; MindCluster's detector counts a round as hung only under 5 s of CPU
in 60 s). A SIGSTOPped rank uses none, nor does one blocked in a gloo collective."""
SEEN_EVERY_S = 0.5
"""How often the controller writes that it is alive (a resume tells how long it was away)."""


@dataclass
class RunOptions:
    startup_s: float | None = None
    """Allowance before the first sign of progress after a (re)start; overrides the job's
    spec.startup_seconds (default max(2 x hang window, 60 s))."""
    table: FaultCodeTable = DEFAULT_TABLE
    rules: EscalationRules = field(default_factory=EscalationRules)
    resume: bool = False


@dataclass
class Proc:
    attempt: int
    running: bool = True
    started_at: float = 0.0
    last_activity: float = 0.0
    progressed: bool = False
    code: int | None = None
    signal: int | None = None
    usage: tuple[float, float, int] | None = None
    """(when, CPU seconds, I/O bytes) of the rank's last usage sample."""


@dataclass
class LauncherLink:
    conn: Connection
    pod: int
    gen: int
    pid: int
    started_attempt: int = 0
    node: str = ""
    stopping: bool = False
    procs: dict[int, Proc] = field(default_factory=dict)

    def running_older_than(self, attempt: int) -> bool:
        return any(p.running and p.attempt < attempt for p in self.procs.values())


@dataclass
class AgentLink:
    conn: Connection
    node: str
    last_hb: float


@dataclass
class Active:
    """The recovery being carried out, until progress resumes."""

    record_id: int
    fault: Fault
    fault_id: int
    action: Action
    tried: frozenset[Action]
    started_at: float
    ranks: tuple[int, ...] = ()
    after_step: int | None = None
    """For a recovery that restarts no process (online retry): progress past this step proves it."""


class Controller:
    def __init__(
        self,
        store: Store,
        engine: Engine,
        state_dir: Path,
        cluster: ClusterConfig,
        job_id: int,
        spec: JobSpec,
        plan: tuple[ChaosEntry, ...],
        options: RunOptions,
        on_event: Callable[[str], None] = print,
        on_output: Callable[[int, int, str], None] | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.state_dir = state_dir
        self.cluster = cluster
        self.job_id = job_id
        self.spec = spec
        self.plan = plan
        self.options = options
        self.recovery = spec.recovery
        self.hang_s = spec.recovery.hang_detect_s
        self.startup_s = options.startup_s or spec.recovery.startup_s
        self.on_event = on_event
        self.on_output = on_output
        self.on_tick = on_tick
        self.inbox: queue.Queue[tuple[Connection, dict[str, Any]]] = queue.Queue()
        self.launchers: dict[int, LauncherLink] = {}
        self.agents: dict[str, AgentLink] = {}
        self.launching: dict[int, tuple[int, float]] = {}
        self.standby: dict[str, LauncherLink] = {}
        """Launchers on standby nodes keeping warm spares (spec.warm_spares), by node."""
        self.standby_launching: dict[str, float] = {}
        self.lost_launchers: dict[int, tuple[int, float]] = {}
        """Pods whose launcher connection closed: (generation, when)."""
        self.tearing_down: dict[int, tuple[LauncherLink, float]] = {}
        self.injected_at: dict[tuple[str, str], float] = {}
        self.injecting: dict[int, tuple[str, str]] = {}
        """Fault-plan entries sent and not yet acknowledged: index -> their injected_at key."""
        self.silent_plan_warned = False
        self.seen_written = 0.0
        self.decide_pending = False
        """Faults wait for a decision: after a resume, until pods are adopted; a failure at
        start, until every pod failed or the start window passed (R-41)."""
        self.decide_after = 0.0
        self.hang_stop = False
        """The processes are being stopped because the job hung: the hang grace applies."""
        self.heal_replies: dict[int, queue.Queue[bool]] = {}
        self.ids = itertools.count(1)
        self.active: Active | None = None
        self.uses_sdk = False
        self.step: int | None = None
        self.step_saved_at = 0.0
        self.adopt_until = 0.0
        self.joining: tuple[int, ...] = ()
        """Ranks of a scale-out that have not reported progress yet (the others wait for them)."""
        self.joining_until = 0.0
        self.next_pass = 0.0
        self._fence: dict[str, Any] = {}
        self._fenced: dict[int, int] = {}
        """Pod -> the oldest generation allowed to write checkpoints (see _write_fence)."""
        self._placed: dict[int, tuple[int, str]] = {}
        with contextlib.suppress(OSError, ValueError):  # a restarted controller keeps the fence
            self._fence = json.loads(self._fence_path().read_text())
            self._fenced = {int(k): int(v) for k, v in self._fence["generations"].items()}
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((engine.bind_host, 0))
        self.server.listen(256)

    # -- connections --------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            conn = Connection(sock)
            threading.Thread(target=self._read_loop, args=(conn,), daemon=True).start()

    def _read_loop(self, conn: Connection) -> None:
        for message in conn:
            if message.get("t") == "healed":
                replies = self.heal_replies.get(int(message.get("id") or 0))
                if replies is not None:
                    replies.put(bool(message["ok"]))
                continue
            self.inbox.put((conn, message))
        self.inbox.put((conn, {"t": "_closed"}))

    # -- lifecycle --------------------------------------------------------------------------------

    def run(self) -> tuple[JobStatus, str]:
        threading.Thread(target=self._accept_loop, daemon=True).start()
        host, port = self.server.getsockname()
        write_controller_address(self.state_dir, host, port, pid=os.getpid())
        now = time.time()
        job = self.store.job(self.job_id)
        self.step = job.last_step
        self.uses_sdk = job.last_step is not None
        if self.options.resume:
            self._resume(job, now)
        else:
            self._start_agents(now)
            self.store.update_job(
                self.job_id,
                status=JobStatus.RUNNING,
                attempt_started_at=now,
                master_port=self._master_port(),
                controller_seen_at=now,
            )
            self._publish_membership()
        try:
            while True:
                self.tick()
                job = self.store.job(self.job_id)
                if job.status.ended:
                    self._finish(job)
                    return job.status, job.reason
        finally:
            self.server.close()

    def _finish(self, job: JobRow) -> None:
        for fault_id, fault, _ in self.store.pending(self.job_id):
            self.store.drop_pending(self.job_id, fault_id)  # the job ended: nothing to decide
            self.event(f"{fault.describe()}: not decided, the job had ended")
        if self.step is not None and self.step != job.last_step:
            self.store.update_job(self.job_id, last_step=self.step)
        if self.step is not None:
            self.store.add_progress(self.job_id, time.time(), self.step)
        self._unfired_at_end(job)
        self._shutdown_pods()

    def _resume(self, job: JobRow, now: float) -> None:
        """Take over a job whose controller died. Away for less than the adopt grace, its pods
        and agents still run and are re-adopted. Away longer, they have ended themselves: the
        agents are started again and the job is rebuilt at job level, recorded as relaunch's own
        outage (no restart budget spent)."""
        self._resume_active()
        seen = job.controller_seen_at
        away = now - seen if seen is not None else 0.0
        grace = self.cluster.adopt_grace_s
        if seen is None or away <= grace:
            self.adopt_until = now + max(2.0, 3 * self.cluster.heartbeat_interval_s)
            self.decide_pending = True
            self.store.update_job(self.job_id, controller_seen_at=now)
            self.event(
                f"controller resumed job {job.name} (attempt {job.attempt}); re-adopting pods"
            )
            return
        self.event(
            f"controller resumed job {job.name} after {away:.0f} s away, longer than "
            f"adopt_grace_s ({grace:g} s): its pods and node agents have ended themselves; "
            "starting the agents again and restarting the job from its checkpoints"
        )
        self.store.update_job(self.job_id, controller_seen_at=now)
        self._decide_waiting()  # what the dead controller left undecided comes first
        if not self.store.job(self.job_id).status.ended:
            outage = Fault(
                FaultKind.CONTROLLER_OUTAGE,
                seen + grace,
                detail=f"controller away {away:.0f} s (adopt_grace_s {grace:g} s)",
            )
            self._fault(outage, source=f"outage:{job.attempt}:{seen:.3f}")
        self._start_agents(time.time(), keep_lost=True)

    def _start_agents(self, now: float, keep_lost: bool = False) -> None:
        """Start every node's agent and wait for them to connect. A new run starts lost nodes
        again (the embedded cluster can); a resume keeps them lost (`keep_lost`)."""
        wanted: set[str] = set()
        for node in self.cluster.nodes:
            row = self.store.node(node.name)
            if row is not None and row.state is NodeState.LOST:
                if keep_lost:
                    continue
                self.store.set_node_state(node.name, NodeState.READY, "agent started again")
            wanted.add(node.name)
            self.engine.start_agent(
                node,
                self.cluster.heartbeat_interval_s,
                self.cluster.adopt_grace_s,
                self.options.rules.network_blip_s,
            )
            self.agents.pop(node.name, None)
        self.adopt_until = now + max(5.0, 4 * self.cluster.heartbeat_timeout_s)
        deadline = now + 15.0
        while time.time() < deadline and not wanted <= set(self.agents):
            self._drain(0.05)
        self.adopt_until = 0.0

    def _everyone_back(self) -> bool:
        """Every live node's agent and every placed pod's launcher has reconnected."""
        live = {
            n.name for n in self.store.nodes() if n.state in (NodeState.READY, NodeState.FAULTY)
        }
        parked = self._parked()
        pods = {p.idx for p in self.store.pods(self.job_id) if p.idx not in parked}
        return live <= set(self.agents) and pods <= set(self.launchers)

    def _resume_active(self) -> None:
        for record in reversed(self.store.records(self.job_id)):
            if record.outcome is Outcome.RUNNING:
                self.active = Active(
                    record.id,
                    record.fault,
                    record.fault_id,
                    record.action,
                    frozenset(record.tried),
                    record.started_at,
                )
            break

    def _shutdown_pods(self) -> None:
        grace = self._stop_grace()
        for link in [*self.launchers.values(), *self.standby.values()]:
            link.conn.send({"t": "shutdown", "grace": grace})
        deadline = time.time() + grace + 5
        while (self.launchers or self.standby) and time.time() < deadline:
            self._drain(0.05)
        for agent in self.agents.values():
            agent.conn.send({"t": "shutdown"})
        self.engine.shutdown()

    def stop(self, reason: str) -> None:
        """Stop the job at the user's request (Ctrl-C)."""
        self.store.update_job(
            self.job_id, status=JobStatus.STOPPED, reason=reason, ended_at=time.time()
        )
        self._unfired_at_end(self.store.job(self.job_id))
        self._shutdown_pods()

    def event(self, text: str) -> None:
        self.store.event(self.job_id, text)
        self.on_event(text)

    # -- the loop ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """Messages are handled as they arrive; the level-triggered checks (each a few store
        queries) run every TICK_S, however many progress reports come in between."""
        while True:  # drain at least once: after a slow pass, heartbeats are waiting
            self._drain(max(0.0, self.next_pass - time.time()))
            if time.time() >= self.next_pass:
                break
        self.next_pass = time.time() + TICK_S
        now = time.time()
        if now - self.seen_written >= SEEN_EVERY_S:
            self.seen_written = now
            self.store.update_job(self.job_id, controller_seen_at=now)
        if now < self.adopt_until and self._everyone_back():
            self.adopt_until = now  # a resume need not wait out the window once all are back
        if self.decide_pending and now >= max(self.adopt_until, self.decide_after):
            self._decide_waiting()
        self._check_requests(now)
        self._check_heartbeats(now)
        self._check_launchers(now)
        self._check_hangs(now)
        self._fire_chaos(now)
        self._scale_out(now)
        self._reconcile(now)
        self._keep_standby(now)
        self._check_done(now)
        if self.on_tick is not None:
            self.on_tick()

    def _check_requests(self, now: float) -> None:
        """What was asked of the job through the store (API, `relaunch stop`), level-triggered."""
        job = self.store.job(self.job_id)
        if job.status.ended:
            return
        if job.stop_requested:
            self.store.update_job(
                self.job_id,
                status=JobStatus.STOPPED,
                reason=f"stopped: {job.stop_requested}",
                ended_at=now,
            )
            self.event(f"stopping the job: {job.stop_requested}")
            return
        if len(job.plan) != len(self.plan):
            self.plan = parse_plan(job.plan, source="stored fault plan")
            self.event(f"fault plan now has {len(self.plan)} entr(ies)")

    def _drain(self, timeout: float) -> None:
        try:
            conn, message = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        self._on_message(conn, message)
        while True:
            try:
                conn, message = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._on_message(conn, message)

    def _on_message(self, conn: Connection, m: dict[str, Any]) -> None:
        kind = m["t"]
        if kind == "hello":
            self._hello(conn, m)
            return
        if kind == "_closed":
            for idx, (leaving, _) in list(self.tearing_down.items()):
                if leaving.conn is conn:
                    del self.tearing_down[idx]
            for idx, closed in list(self.launchers.items()):
                if closed.conn is conn:
                    del self.launchers[idx]
                    self.lost_launchers[idx] = (closed.gen, time.time())
            for node, standby in list(self.standby.items()):
                if standby.conn is conn:
                    del self.standby[node]
            return
        if kind == "hb":
            agent = self.agents.get(m["node"])
            if agent is not None and agent.conn is conn:
                agent.last_hb = time.time()
                self._chip_health(m)
            return
        if kind == "injected":
            self._injected(m)
            return
        link = next((lk for lk in self.launchers.values() if lk.conn is conn), None)
        if link is None:
            return
        if kind == "usage":
            self._usage(link, m)
            return
        if kind == "progress_batch":
            for report in m["reports"]:
                self._on_message(conn, report)
            return
        rank = int(m.get("rank", -1))
        if kind == "started":
            link.procs[rank] = Proc(m["attempt"], True, m["at"], m["at"])
        elif kind in ("output", "progress"):
            proc = link.procs.get(rank)
            if proc is not None and proc.attempt == m["attempt"]:
                proc.last_activity = time.time()
                proc.progressed = True
            if kind == "output" and self.on_output is not None:
                self.on_output(link.pod, rank, m["line"])
            if kind == "progress":
                self.uses_sdk = True
                if rank in self.joining:
                    self.joining = ()
                    self.event("scale-out: the joining ranks are training")
                self.step = max(self.step or 0, int(m["step"]))
                if time.time() - self.step_saved_at > 0.5:
                    self.step_saved_at = time.time()
                    self.store.update_job(self.job_id, last_step=self.step)
                    self.store.add_progress(self.job_id, self.step_saved_at, self.step)
            self._verify(
                link, rank, kind, m["attempt"], int(m["step"]) if kind == "progress" else None
            )
        elif kind == "exit":
            self._exit(link, m)
        elif kind == "stopped":
            link.stopping = False

    def _hello(self, conn: Connection, m: dict[str, Any]) -> None:
        if m["role"] == "agent":
            self.agents[m["node"]] = AgentLink(conn, m["node"], time.time())
            return
        if m["job"] != self.job_id:
            conn.send({"t": "shutdown", "grace": 0})
            return
        if m.get("standby"):
            self._standby_hello(conn, m)
            return
        pods = {p.idx: p for p in self.store.pods(self.job_id)}
        pod = pods.get(m["pod"])
        if pod is None or pod.generation != m["gen"]:
            conn.send({"t": "shutdown", "grace": 0})
            return
        current = self.launchers.get(m["pod"])
        if (
            current is not None
            and current.gen == m["gen"]
            and not current.conn.closed
            and current.pid != m["pid"]
        ):
            conn.send(
                {"t": "shutdown", "grace": 0}
            )  # a duplicate started across a controller restart
            return
        link = LauncherLink(
            conn, m["pod"], m["gen"], m["pid"], started_attempt=m["attempt"], node=m["node"]
        )
        now = time.time()
        for rank_text, p in m["procs"].items():
            link.procs[int(rank_text)] = Proc(p["attempt"], p["running"], now, now, code=p["code"])
        self.launchers[m["pod"]] = link
        membership = self.store.job(self.job_id).membership
        if self.recovery.process_level and membership is not None:
            conn.send({"t": "membership", "m": membership})
        self.launching.pop(m["pod"], None)
        self.lost_launchers.pop(m["pod"], None)

    def _standby_hello(self, conn: Connection, m: dict[str, Any]) -> None:
        node = m["node"]
        self.standby_launching.pop(node, None)
        current = self.standby.get(node)
        if node not in self._standby_nodes() | self._awaiting_launcher() or (
            current is not None and not current.conn.closed and current.pid != m["pid"]
        ):
            conn.send({"t": "shutdown", "grace": 0})
            return
        self.standby[node] = LauncherLink(conn, -1, 0, m["pid"])
        self.event(f"standby launcher on {node}: {self.spec.warm_spares} warm spare(s)")

    # -- detectors ----------------------------------------------------------------------------------

    def _chip_health(self, m: dict[str, Any]) -> None:
        node = m["node"]
        self.store.set_chip_health(
            node,
            [{"chip": f["chip"], "code": f["code"], "kind": f["kind"]} for f in m["faults"]],
            time.time(),
        )
        pod = next((p.idx for p in self.store.pods(self.job_id) if p.node == node), None)
        row = self.store.node(node)
        if m["faults"] and row is not None and row.state is NodeState.READY:
            self.store.set_node_state(node, NodeState.FAULTY, "chip fault reported")
        elif not m["faults"] and row is not None and row.state is NodeState.FAULTY:
            self.store.set_node_state(node, NodeState.READY, "chips healthy")
        for f in m["faults"]:
            kind = FaultKind.MEMORY_UCE if f["kind"] == "memory-uce" else FaultKind.CHIP
            at = self.injected_at.pop(("chip", node), f["at"])
            fault = Fault(kind, at, node=node, chip=f["chip"], pod=pod, code=f["code"])
            self._fault(fault, source=f"{node}:{f['seq']}")
        link = m.get("link")
        if link is not None:
            at = self.injected_at.pop(("net", node), link["at"])
            fault = Fault(FaultKind.NETWORK, at, node=node, pod=pod, duration_s=link["duration_s"])
            self._fault(fault, source=f"{node}:{link['seq']}")

    def _check_heartbeats(self, now: float) -> None:
        if now < self.adopt_until:
            return
        timeout = self.cluster.heartbeat_timeout_s
        gone = self.engine.lost_nodes()
        for node in self.store.nodes():
            if node.state not in (NodeState.READY, NodeState.FAULTY):
                continue  # lost already, or isolated: no pod of the job goes there
            agent = self.agents.get(node.name)
            last = agent.last_hb if agent is not None else (self.adopt_until or now)
            if now - last > timeout or node.name in gone:
                # whichever comes first: the agent's silence or the engine's word (Ray: node dead)
                why = (
                    f"no heartbeat for {timeout:g} s"
                    if now - last > timeout
                    else "the engine reports the node dead"
                )
                self.store.set_node_state(node.name, NodeState.LOST, why)
                self.agents.pop(node.name, None)
                at = self.injected_at.pop(("node", node.name), last)
                self.event(f"node {node.name} lost: {why} (last heartbeat {now - last:.1f} s ago)")
                self._fault(
                    Fault(FaultKind.NODE_LOST, at, node=node.name),
                    source=f"lost:{node.name}:{last:.3f}",
                )

    def _check_launchers(self, now: float) -> None:
        """A launcher that vanished while its node lives: the pod's container died."""
        grace = self.cluster.heartbeat_timeout_s + 2 * self.cluster.heartbeat_interval_s
        pods = {p.idx: p for p in self.store.pods(self.job_id)}
        for idx, (gen, since) in list(self.lost_launchers.items()):
            pod = pods.get(idx)
            if pod is None or idx in self.launchers or pod.generation != gen:
                # moved since (a recovery replaced it): the new launcher is not the lost one
                self.lost_launchers.pop(idx, None)
                continue
            node = self.store.node(pod.node)
            if node is None or node.state is NodeState.LOST:
                self.lost_launchers.pop(idx, None)
                continue
            if now - since > grace:
                self.lost_launchers.pop(idx, None)
                self.launching.pop(idx, None)
                fault = Fault(
                    FaultKind.PROCESS_EXIT,
                    since,
                    node=pod.node,
                    pod=idx,
                    signal=9,
                    detail="launcher died",
                )
                self._fault(fault, source=f"launcher:{idx}:{pod.generation}:{since:.3f}")

    def _check_hangs(self, now: float) -> None:
        """R-25: a rank with no progress and no output for the window is hung. When several are
        silent (one stuck rank stalls its peers at the next collective), the one silent longest is
        reported, once: the recovery restarts them all."""
        job = self.store.job(self.job_id)
        if job.status is not JobStatus.RUNNING and self.active is None:
            return
        silent: list[tuple[float, LauncherLink, int, float]] = []
        if self.joining and now < self.joining_until:
            return  # a scale-out: the group waits for the joining ranks to start
        waiting = self.active is not None and self.active.action.process_level
        for link in self.launchers.values():
            if link.stopping:
                continue
            for rank, proc in link.procs.items():
                if not proc.running or proc.attempt != job.attempt:
                    continue
                if waiting and self.active is not None and rank not in self.active.ranks:
                    continue  # healthy ranks wait for the replacements: not a hang
                window = self.hang_s if proc.progressed else self.startup_s
                if now - proc.last_activity > window:
                    silent.append((proc.last_activity, link, rank, window))
        if not silent:
            return
        _, link, rank, window = min(silent, key=lambda item: item[0])
        for other in self.launchers.values():
            for proc in other.procs.values():
                proc.last_activity = max(proc.last_activity, now)  # one hang fault per silence
        at = self.injected_at.pop(("hang", "job"), now - window)
        fault = Fault(
            FaultKind.HANG, at, pod=link.pod, rank=rank, detail=f"silent for {window:g} s"
        )
        self._fault(fault, source=f"hang:{job.attempt}:{rank}:{now:.3f}")

    def _usage(self, link: LauncherLink, m: dict[str, Any]) -> None:
        """A rank that computes or does I/O is alive though silent (R-25): its usage samples
        count as activity for hang detection, not as progress. I/O counts only for jobs that do
        not report progress through the SDK (their steps are the better signal)."""
        now = time.time()
        for rank_text, (cpu, io) in m["ranks"].items():
            proc = link.procs.get(int(rank_text))
            if proc is None or proc.attempt != m["attempt"]:
                continue
            if proc.usage is not None:
                then, cpu_then, io_then = proc.usage
                busy = cpu - cpu_then >= ACTIVE_CPU_SHARE * max(now - then, 1e-3)
                io_moved = not self.uses_sdk and io > io_then
                if busy or io_moved:
                    proc.last_activity = now
            proc.usage = (now, float(cpu), int(io))

    def _injected(self, m: dict[str, Any]) -> None:
        """A launcher or agent says whether a fault-plan entry it was sent really fired."""
        index = m.get("index")
        if not isinstance(index, int):
            return
        key = self.injecting.pop(index, None)
        if m.get("ok"):
            return
        if key is not None:
            self.injected_at.pop(key, None)  # nothing will be detected: later entries go on
        self._not_fired(index, str(m.get("why") or "the target refused it"), time.time())

    def _not_fired(self, index: int, why: str, now: float) -> None:
        entry = next((e for e in self.plan if e.index == index), None)
        self.store.mark_fired(self.job_id, index, now, note=f"not fired: {why}")
        what = entry.describe() if entry is not None else f"entry {index}"
        self.event(f"fault plan: {what}: not fired: {why}")

    def _exit(self, link: LauncherLink, m: dict[str, Any]) -> None:
        rank = m["rank"]
        proc = link.procs.setdefault(rank, Proc(m["attempt"]))
        proc.running = False
        proc.code, proc.signal = m["code"], m["signal"]
        job = self.store.job(self.job_id)
        if m["expected"] or m["attempt"] != job.attempt or (m["code"] == 0 and not m["signal"]):
            return
        pod = self._pod(link.pod)
        at = self.injected_at.pop(("exit", str(rank)), m["at"])
        fault = Fault(
            FaultKind.PROCESS_EXIT,
            at,
            node=pod.node,
            pod=link.pod,
            rank=rank,
            exit_code=m["code"],
            signal=m["signal"],
            detail=str(m.get("detail") or ""),
        )
        # a replacement (process level) reuses attempt, generation and rank: the exit time tells
        self._fault(fault, source=f"exit:{job.attempt}:{link.gen}:{rank}:{m['at']:.6f}")

    # -- fault injection ------------------------------------------------------------------------------

    def _fire_chaos(self, now: float) -> None:
        """Fire the fault plan's due entries, one per pass. An entry whose target has gone (its
        node isolated or lost, its pod parked, its rank exited) is recorded as not fired, with
        the reason, and never holds back the entries after it; one whose target is still
        starting waits for it."""
        if not self.plan:
            return
        job = self.store.job(self.job_id)
        if job.status is not JobStatus.RUNNING or self.active is not None:
            return
        # One injected fault at a time: the next waits until the last one was detected.
        for key, at in list(self.injected_at.items()):
            if now - at > self.startup_s:
                del self.injected_at[key]
        self.injecting = {i: k for i, k in self.injecting.items() if k in self.injected_at}
        if self.injected_at:
            return
        done = self.store.fired(self.job_id)
        elapsed = now - (job.attempt_started_at or now)
        self._warn_silent_plan(done, now, elapsed)
        for entry in self.plan:
            if entry.index in done or not entry.due(self.step, elapsed):
                continue
            failpoints.reach("fault-plan-due")
            target = self._chaos_target(entry)
            if target is None:
                continue  # its rank is (re)starting: it fires once the rank runs
            if isinstance(target, str):
                self._not_fired(entry.index, target, now)
                continue
            self.store.mark_fired(self.job_id, entry.index, now)
            self.event(f"fault plan: {entry.describe()}")
            self._inject(entry, target, now)
            return  # one per pass, so each is seen on its own

    def _warn_silent_plan(
        self, done: dict[int, tuple[float, str]], now: float, elapsed: float
    ) -> None:
        """`at_step` entries wait for progress reports: say so once if none has come."""
        waiting = [e for e in self.plan if e.at_step is not None and e.index not in done]
        if self.silent_plan_warned or not waiting or self.step is not None:
            return
        if elapsed > self.startup_s:
            self.silent_plan_warned = True
            self.event(
                f"fault plan: {len(waiting)} entr(ies) wait for a step (at_step), and the job "
                f"has reported none in {elapsed:.0f} s: at_step needs the script to call "
                "relaunch.train.report_progress(step); use after_s otherwise"
            )

    def _chaos_target(self, entry: ChaosEntry) -> tuple[str | None, int | None] | str | None:
        """Where `entry` fires now: (node, rank) to hit; a string saying why it cannot fire any
        more; or None while its target is starting."""
        parked = self._parked()
        nodes = {n.name: n for n in self.store.nodes()}
        rank = None
        if entry.pod is not None:
            pods = {p.idx: p for p in self.store.pods(self.job_id)}
            pod = pods.get(entry.pod)
            if pod is None:
                return f"job {self.spec.name} has no pod {entry.pod}"
            if entry.pod in parked:
                return f"pod {entry.pod} is parked (elastic scale-in)"
            node_name = pod.node
        else:
            node_name = entry.node or ""
        node = nodes.get(node_name)
        if node is None:
            return f"node {node_name} is not in the cluster"
        if node.state in (NodeState.LOST, NodeState.ISOLATED):
            return f"node {node_name} is {node.state.value.lower()}"
        if entry.targets_process:
            assert entry.pod is not None
            rank = entry.target_rank(self.spec.procs_per_pod)
            link = self.launchers.get(entry.pod)
            proc = link.procs.get(rank) if link is not None else None
            attempt = self.store.job(self.job_id).attempt
            if proc is None or proc.attempt != attempt:
                return None
            if not proc.running:
                return f"rank {rank} has exited (code {proc.code}, signal {proc.signal})"
        elif entry.kind is not ChaosKind.NODE_DOWN:
            if node_name not in self.agents:
                return None
            if (
                entry.kind in (ChaosKind.CHIP_FAULT, ChaosKind.MEMORY_UCE)
                and entry.chip >= node.chips
            ):
                return (
                    f"node {node_name} has {node.chips} chip(s); chip {entry.chip} does not exist"
                )
        return node_name, rank

    def _inject(self, entry: ChaosEntry, target: tuple[str | None, int | None], now: float) -> None:
        node, rank = target
        if entry.kind in (ChaosKind.PROCESS_EXIT, ChaosKind.HANG):
            assert entry.pod is not None and rank is not None
            link = self.launchers[entry.pod]
            kind = "exit" if entry.kind is ChaosKind.PROCESS_EXIT else "hang"
            key = (kind, str(rank) if kind == "exit" else "job")
            self.injected_at[key] = now
            self.injecting[entry.index] = key
            link.conn.send(
                {
                    "t": "inject",
                    "index": entry.index,
                    "kind": kind,
                    "rank": rank,
                    "exit_code": entry.exit_code,
                }
            )
        elif entry.kind is ChaosKind.NODE_DOWN:
            assert node is not None
            self.injected_at[("node", node)] = now
            self.engine.kill_node(node)
        else:
            assert node is not None
            agent = self.agents[node]
            key = ("net" if entry.kind is ChaosKind.NETWORK else "chip", node)
            self.injected_at[key] = now
            self.injecting[entry.index] = key
            if entry.kind is ChaosKind.NETWORK:
                agent.conn.send(
                    {
                        "t": "network",
                        "index": entry.index,
                        "duration_s": entry.duration_s,
                        "heals": entry.heals,
                    }
                )
            else:
                agent.conn.send(
                    {
                        "t": "chip_fault",
                        "index": entry.index,
                        "chip": entry.chip,
                        "code": entry.code,
                        "heals": entry.heals,
                        "kind": entry.kind.value,
                    }
                )

    def _unfired_at_end(self, job: JobRow) -> None:
        """Every entry the job ended without firing is recorded as not fired, saying why."""
        if not self.plan:
            return
        done = self.store.fired(self.job_id)
        now = time.time()
        elapsed = now - (job.attempt_started_at or now)
        for entry in self.plan:
            if entry.index in done:
                continue
            if entry.due(self.step, elapsed):
                why = (
                    f"the job ended ({job.status.value}) while the entry waited for an earlier "
                    "fault to be detected and recovered"
                )
            elif entry.at_step is not None and self.step is None:
                why = (
                    "the job never reported a step (at_step needs the script to call "
                    "relaunch.train.report_progress)"
                )
            elif entry.at_step is not None:
                why = f"the job ended ({job.status.value}) at step {self.step}, before step {entry.at_step}"
            else:
                why = (
                    f"the job ended ({job.status.value}) {elapsed:.1f} s into attempt "
                    f"{job.attempt}, before {entry.after_s:g} s"
                )
            self._not_fired(entry.index, why, now)

    # -- faults and decisions --------------------------------------------------------------------------

    def _fault(self, fault: Fault, source: str) -> None:
        """Store a fault and what waits for a decision because of it, in one transaction; then
        decide. A controller killed in between finds the decision still waiting on resume."""
        now = time.time()
        job = self.store.job(self.job_id)
        if job.status.ended:
            return
        active = self.active
        superseded = False
        with self.store.transaction():
            fault_id = self.store.add_fault(self.job_id, fault, now, source)
            if fault_id is None:
                return  # seen before (a heartbeat repeats it, or a restarted controller re-reads it)
            waiting, tried = fault_id, frozenset[Action]()
            if active is not None:
                self.store.settle_record(active.record_id, Outcome.FAILED)
                finer = active.action not in JOB_LEVEL
                if finer and fault.kind in (FaultKind.PROCESS_EXIT, FaultKind.HANG):
                    # the finer recovery did not work: its fault goes one level down
                    superseded = True
                    waiting, tried = active.fault_id, active.tried | {active.action}
            self.store.add_pending(self.job_id, waiting, sorted(tried))
        if active is not None:
            self.active = None
        self.event(f"fault: {fault.describe()}")
        if superseded and active is not None:
            self.event(f"{active.action.value} did not recover {active.fault.describe()}")
        self.next_pass = 0.0  # act on it now, not at the next scheduled pass
        failpoints.reach("fault-stored")
        self._decide_waiting()

    def _decide_waiting(self) -> None:
        """Decide every fault that waits for a decision (normally the one just stored; after a
        resume, what the killed controller stored and did not decide). Not while pods and agents
        are still being re-adopted: healing a chip needs its agent."""
        if time.time() < self.adopt_until:
            self.decide_pending = True
            return
        waiting = self.store.pending(self.job_id)
        hold = self._failing_at_start(waiting)
        if hold is not None:
            self.decide_pending, self.decide_after = True, hold
            return
        self.decide_pending = False
        for fault_id, fault, tried in waiting:
            if self.store.job(self.job_id).status.ended:
                return
            if self.active is not None:  # a newer fault outranks a recovery under way
                self.store.settle_record(self.active.record_id, Outcome.FAILED)
                self.active = None
            self._decide(fault, fault_id, tried)

    def _failing_at_start(
        self, waiting: list[tuple[int, Fault, frozenset[Action]]]
    ) -> float | None:
        """R-41: "every pod failed within a few seconds of each other at start" is only known
        once every pod has failed. A job whose policy reads it (fault-retry-times without
        job-unconditional-retry) decides an exit in the first FAILED_AT_START_S of an attempt
        when every pod has failed, or when that window has passed; returns until when to hold."""
        r = self.recovery
        if not waiting or r.fault_retry_times == 0 or r.unconditional_retry:
            return None
        if any(f.kind is not FaultKind.PROCESS_EXIT or tried for _, f, tried in waiting):
            return None
        job = self.store.job(self.job_id)
        window_ends = (job.attempt_started_at or 0.0) + FAILED_AT_START_S
        if time.time() >= window_ends or self._all_pods_failed(job):
            return None
        return window_ends

    def _all_pods_failed(self, job: JobRow) -> bool:
        failed = {
            link.pod
            for link in self.launchers.values()
            for p in link.procs.values()
            if p.attempt == job.attempt and not p.running and (p.code or p.signal)
        }
        return len(failed) == len(self.store.pods(self.job_id))

    def _decide(self, fault: Fault, fault_id: int, tried: frozenset[Action]) -> None:
        """Climb down the ladder for `fault` until an action is under way or the job ends. Each
        record is stored with the desired-state change it makes and with what still waits for a
        decision, in one transaction."""
        while True:
            now = time.time()
            history = self.store.history(self.job_id, before_fault=fault_id)
            view = self._cluster_view(fault, now)
            decision = decide(
                self.recovery,
                fault,
                history,
                view,
                now,
                table=self.options.table,
                rules=self.options.rules,
                tried=tried,
            )
            self.event(f"decision: {decision.summary()}")
            action = decision.action
            self.hang_stop = fault.kind is FaultKind.HANG
            if action is Action.IN_PLACE and not self._heal(fault):
                record = self._record(
                    decision, fault_id, tried, now, Outcome.FAILED, apply=False,
                    still_waiting=tried | {action},
                )  # fmt: skip
                self.event(f"in-place: the chip did not heal (record {record})")
                tried |= {action}
                continue
            if action.final or action.hands_over:
                outcome = Outcome.FAILED if action is Action.FAIL else Outcome.SUCCEEDED
                self._record(
                    decision, fault_id, tried, now, outcome,
                    still_waiting=tried | {action} if action.hands_over else None,
                )  # fmt: skip
                if action.hands_over:
                    tried |= {action}
                    continue
                return
            self._begin(decision, fault, fault_id, tried, now)
            return

    def _begin(
        self,
        decision: Decision,
        fault: Fault,
        fault_id: int,
        tried: frozenset[Action],
        now: float,
    ) -> None:
        """Carry out a decision whose record says it runs until progress resumes."""
        action = decision.action
        attempt = self.store.job(self.job_id).attempt
        record_id = self._record(decision, fault_id, tried, now, Outcome.RUNNING)
        failpoints.reach("decision-stored")
        ranks: tuple[int, ...] = ()
        after_step = None
        if action is Action.PROCESS_IN_PLACE:
            ranks = self._faulty_ranks(fault)
        elif action is Action.PROCESS_RESCHEDULE:
            ranks = tuple(r for pod in decision.pods for r in self._ranks_of(pod))
        elif action in (Action.PROCESS_RETRY, Action.SCALE_IN):
            after_step = self.step or 0
        self.active = Active(record_id, fault, fault_id, action, tried, now, ranks, after_step)
        if self.recovery.process_level:
            if action is Action.PROCESS_RETRY:
                self._publish_membership(retry=True)
            elif action in (Action.PROCESS_IN_PLACE, Action.PROCESS_RESCHEDULE):
                self._publish_membership(joiners=ranks)
            elif action is Action.SCALE_IN:
                for idx in decision.pods:
                    leaving = self.launchers.pop(idx, None)
                    if leaving is not None:
                        leaving.conn.send({"t": "shutdown", "grace": 0.0})
                        self.tearing_down[idx] = (leaving, now)
                self._publish_membership(parked=self._parked() | set(decision.pods))
            elif self.store.job(self.job_id).attempt != attempt:
                self._publish_membership()  # every process starts again: a fresh group
        if action is Action.PROCESS_IN_PLACE:
            self._restart_ranks(ranks)

    def _record(
        self,
        d: Decision,
        fault_id: int,
        tried: frozenset[Action],
        now: float,
        outcome: Outcome,
        apply: bool = True,
        still_waiting: frozenset[Action] | None = None,
    ) -> int:
        """Store a record, the desired-state change it makes (`apply`), and whether its fault
        still waits for a decision (`still_waiting`: the actions tried by then), together."""
        budgets = d.budgets_left
        with self.store.transaction():
            record_id = self.store.add_record(
                self.job_id,
                fault_id,
                d.action,
                d.assessment.cause,
                d.reason,
                d.pods,
                d.isolate_nodes,
                sorted(d.consumes),
                sorted(tried),
                d.counters,
                {"job": budgets.job, "pod": budgets.pod, "fault_retry": budgets.fault_retry}
                if budgets
                else {},
                now,
                outcome,
            )
            if apply:
                self._apply(d, now)
            if still_waiting is None:
                self.store.drop_pending(self.job_id, fault_id)
            else:
                self.store.add_pending(self.job_id, fault_id, sorted(still_waiting))
        return record_id

    def _apply(self, d: Decision, now: float) -> None:
        """The desired-state change a decision makes, inside the record's transaction."""
        for node in d.isolate_nodes:
            row = self.store.node(node)
            if row is not None and row.state is not NodeState.LOST:
                self.store.set_node_state(
                    node, NodeState.ISOLATED, f"isolated: {d.assessment.fault.describe()}", now
                )
            elif row is not None:
                self.store.set_node_state(
                    node, NodeState.LOST, f"lost and isolated: {d.assessment.fault.describe()}"
                )
        job = self.store.job(self.job_id)
        action = d.action
        if action is Action.FAIL:
            self.store.update_job(
                self.job_id, status=JobStatus.FAILED, reason=d.reason, ended_at=now
            )
            return
        if action in (Action.IGNORE, Action.PROCESS_RETRY, Action.PROCESS_IN_PLACE):
            return  # no container changes (R-04 / R-05: the counters stay)
        if action.hands_over:
            return
        pods = self.store.pods(self.job_id)
        moved = (
            set(d.pods)
            if action in (Action.POD_RESCHEDULE, Action.PROCESS_RESCHEDULE)
            else ({p.idx for p in pods} if action in JOB_LEVEL else set())
        )
        nodes = self._placement(pods, moved, d.isolate_nodes)
        for pod in pods:
            counters = d.counters[pod.idx]
            gen = pod.generation + (1 if pod.idx in moved else 0)
            node = nodes.get(pod.idx, pod.node)
            workdir = str(self._workdir(pod.idx, gen)) if pod.idx in moved else pod.workdir
            self.store.put_pod(
                PodRow(
                    self.job_id,
                    pod.idx,
                    node,
                    gen,
                    counters.schedule_cnt,
                    counters.proc_start_cnt,
                    workdir,
                )
            )
        if action is Action.SCALE_IN:
            self.store.update_job(self.job_id, status=JobStatus.RECOVERING)
            return
        if action is Action.PROCESS_RESCHEDULE:
            # Only the moved pods start (at the current attempt, as joiners); the rest run on.
            self.store.update_job(self.job_id, status=JobStatus.RECOVERING)
            return
        self.store.update_job(
            self.job_id,
            status=JobStatus.RECOVERING,
            attempt=job.attempt + 1,
            attempt_started_at=now,
            master_port=self._master_port(),
        )

    def _placement(
        self, pods: list[PodRow], moved: set[int], isolating: tuple[str, ...]
    ) -> dict[int, str]:
        """Moved pods go, in order, to the first Ready nodes with chips for them: for a pod-level
        move, nodes no staying pod uses; for a whole-job rebuild, every healthy node."""
        staying = {p.node for p in pods if p.idx not in moved}
        nodes = [n for n in self.store.nodes() if n.schedulable and n.name not in isolating]
        if staying:
            nodes = [n for n in nodes if n.name not in staying]
        free = _slots(nodes, self.spec.chips_per_pod, one_per_node=bool(staying))
        return {pod: free[i] for i, pod in enumerate(sorted(moved)) if i < len(free)}

    def _cluster_view(self, fault: Fault, now: float) -> ClusterView:
        pods = self.store.pods(self.job_id)
        used = {p.node for p in pods}
        standby = tuple(
            n.name
            for n in self.store.nodes()
            if n.schedulable and n.name not in used and n.chips >= self.spec.chips_per_pod
        )
        job = self.store.job(self.job_id)
        at_start = (
            fault.kind is FaultKind.PROCESS_EXIT
            and fault.at - (job.attempt_started_at or fault.at) < FAILED_AT_START_S
            and self._all_pods_failed(job)
        )
        schedulable = [n for n in self.store.nodes() if n.schedulable]
        slots = tuple(
            (n.name, len(_slots([n], self.spec.chips_per_pod, one_per_node=False)))
            for n in schedulable
        )
        return ClusterView(
            pods=tuple(PodView(p.idx, p.node, holds_rank0=p.idx == 0) for p in pods),
            standby_nodes=standby,
            all_pods_failed_at_start=at_start,
            slots=slots,
        )

    def _heal(self, fault: Fault) -> bool:
        agent = self.agents.get(fault.node or "")
        if agent is None:
            return fault.kind is FaultKind.NETWORK
        request = next(self.ids)
        replies: queue.Queue[bool] = queue.Queue()
        self.heal_replies[request] = replies
        try:
            agent.conn.send({"t": "heal", "id": request})
            return replies.get(timeout=5.0)
        except queue.Empty:
            return False
        finally:
            self.heal_replies.pop(request, None)

    def _ranks_of(self, pod: int) -> tuple[int, ...]:
        first = pod * self.spec.procs_per_pod
        return tuple(range(first, first + self.spec.procs_per_pod))

    def _faulty_ranks(self, fault: Fault) -> tuple[int, ...]:
        """The processes a process-level in-place restart replaces: the one that failed, or the
        one driving the faulty chip."""
        if fault.rank is not None:
            return (fault.rank,)
        if fault.pod is not None and fault.chip is not None:
            return (fault.pod * self.spec.procs_per_pod + fault.chip % self.spec.procs_per_pod,)
        return ()

    def _restart_ranks(self, ranks: tuple[int, ...]) -> None:
        if not ranks:
            return
        pod = ranks[0] // self.spec.procs_per_pod
        link = self.launchers.get(pod)
        if link is None:
            return
        job = self.store.job(self.job_id)
        running = [r for r in ranks if (p := link.procs.get(r)) is not None and p.running]
        if running:  # a process on a faulty chip still runs: replace it
            link.conn.send({"t": "stop", "grace": 0.0, "ranks": running})
        link.conn.send(
            {
                "t": "start",
                "attempt": job.attempt,
                "env": self._env(self._pod(link.pod), job.attempt),
                "ranks": list(ranks),
            }
        )

    def _parked(self) -> set[int]:
        """Pods left out of the group by an elastic scale-in, until a node takes them back."""
        membership = self.store.job(self.job_id).membership or {}
        return {int(i) for i in membership.get("parked", [])}

    def _publish_membership(
        self, joiners: tuple[int, ...] = (), retry: bool = False, parked: set[int] | None = None
    ) -> None:
        """The next generation of the process group (train.group reads it): a new store port
        unless it is an online retry, which keeps the group. Parked pods' ranks are left out and
        the others are numbered densely (elastic training)."""
        if not self.recovery.process_level:
            return
        job = self.store.job(self.job_id)
        previous = job.membership or {}
        if parked is None:
            parked = self._parked() if (joiners or retry) else set()
        generation = int(previous.get("generation", 0)) + 1
        if retry and previous:
            port = int(previous["port"])
        elif not previous or not (joiners or parked):
            port = job.master_port
        else:
            port = self._master_port()
        active = [p for p in self.store.pods(self.job_id) if p.idx not in parked]
        members = [r for p in active for r in self._ranks_of(p.idx)]
        membership = {
            "generation": generation,
            "addr": self.engine.node_address(active[0].node) if active else "127.0.0.1",
            "port": port,
            "world_size": len(members),
            "ranks": {str(r): i for i, r in enumerate(members)},
            "joiners": sorted(joiners),
            "retry": retry,
            "pods": {str(p.idx): p.generation for p in active},
            "parked": sorted(parked),
            "procs_per_pod": self.spec.procs_per_pod,
        }
        self.store.update_job(self.job_id, membership=membership)
        for link in self.launchers.values():
            link.conn.send({"t": "membership", "m": membership})
        what = (
            "online retry"
            if retry
            else f"replacements {sorted(joiners)}"
            if joiners
            else "fresh group"
        )
        if parked:
            what += f"; pods {sorted(parked)} left out"
        self.event(f"process group generation {generation}: {what}, world size {len(members)}")

    def _scale_out(self, now: float) -> None:
        """Elastic training: a parked pod goes back into the group as soon as a Ready node with
        a live agent can take it; its ranks join the running job."""
        parked = self._parked()
        job = self.store.job(self.job_id)
        if not parked or self.active is not None or job.status is not JobStatus.RUNNING:
            return
        pods = self.store.pods(self.job_id)
        free = self._free_nodes({p.node for p in pods if p.idx not in parked})
        back: list[int] = []
        for idx, node in zip(sorted(parked), free, strict=False):
            pod = next(p for p in pods if p.idx == idx)
            gen = pod.generation + 1
            self.store.put_pod(
                PodRow(
                    self.job_id,
                    idx,
                    node,
                    gen,
                    pod.schedule_cnt + 1,
                    1,
                    str(self._workdir(idx, gen)),
                )
            )
            back.append(idx)
            self.event(f"scale-out: pod {idx} back on {node}")
        if back:
            self.joining = tuple(r for idx in back for r in self._ranks_of(idx))
            self.joining_until = now + self.startup_s
            self._publish_membership(joiners=self.joining, parked=parked - set(back))

    def _verify(
        self, link: LauncherLink, rank: int, kind: str, attempt: int, step: int | None
    ) -> None:
        """A recovery worked once training makes progress again."""
        active = self.active
        if active is None:
            return
        job = self.store.job(self.job_id)
        if attempt != job.attempt or (self.uses_sdk and kind != "progress"):
            return
        if active.after_step is not None:
            if kind != "progress" or step is None or step <= active.after_step:
                return
        else:
            if active.ranks and rank not in active.ranks:
                return
            proc = link.procs.get(rank)
            if proc is None or proc.started_at < active.started_at:
                return
        now = time.time()
        self.active = None
        self.store.settle_record(
            active.record_id, Outcome.SUCCEEDED, resumed_at=now, fault_at=active.fault.at
        )
        self.store.update_job(self.job_id, status=JobStatus.RUNNING)
        self.hang_stop = False
        self.event(
            f"{active.action.value} worked: progress resumed {now - active.fault.at:.2f} s after the fault"
        )
        failpoints.reach("recovered")

    # -- convergence ------------------------------------------------------------------------------------

    def _reconcile(self, now: float) -> None:
        job = self.store.job(self.job_id)
        if job.status.ended or now < self.adopt_until:
            return
        pods = self.store.pods(self.job_id)
        self._write_fence(pods)
        retired = 0
        for stale in list(self.launchers.values()):
            desired = next((p for p in pods if p.idx == stale.pod), None)
            if desired is None or desired.generation != stale.gen:
                stale.conn.send({"t": "shutdown", "grace": self._stop_grace()})
                self.launchers.pop(stale.pod, None)
                retired += 1
                old_node = self.store.node(stale.node)
                if old_node is None or old_node.state is not NodeState.LOST:
                    # a lost node's pods are not waited for: it may never answer (hung or cut
                    # off); they are fenced instead, and get this shutdown if it comes back
                    self.tearing_down[stale.pod] = (stale, now)
        if retired:
            self._said_stopping(retired, "their containers are rebuilt")
        parked = self._parked()
        pods = [p for p in pods if p.idx not in parked]
        ready = True
        for pod in pods:
            if pod.idx in self.launchers:
                continue
            ready = False
            if self._teardown_pending(pod.idx, now):
                continue
            launching = self.launching.get(pod.idx)
            node = self.store.node(pod.node)
            if node is None or node.state is NodeState.LOST or pod.node not in self.agents:
                continue
            standby = self.standby.pop(pod.node, None)
            if standby is not None and not standby.conn.closed:
                self._assume(standby, pod)
                continue
            if launching is None or launching[0] != pod.generation or now - launching[1] > 30:
                self.launching[pod.idx] = (pod.generation, now)
                self.engine.start_pod(self._launch_plan(pod))
        if not ready:
            return
        links = [self.launchers[p.idx] for p in pods]
        old = [lk for lk in links if lk.running_older_than(job.attempt)]
        if old:
            grace = self._stop_grace()
            stopping = [lk for lk in old if not lk.stopping]
            for link in stopping:
                link.stopping = True
                link.conn.send({"t": "stop", "grace": grace})
            if stopping:
                self._said_stopping(len(stopping), "their containers stay")
            return
        if any(lk.stopping for lk in links):
            return
        started = False
        for pod, link in zip(pods, links, strict=True):
            if link.started_attempt < job.attempt:
                link.started_attempt = job.attempt
                started = True
                link.conn.send(
                    {"t": "start", "attempt": job.attempt, "env": self._env(pod, job.attempt)}
                )
        if started and job.attempt > 1:
            failpoints.reach("starting")

    def _said_stopping(self, pods: int, containers: str) -> None:
        why = "; the job hung: hang grace" if self.hang_stop else ""
        self.event(
            f"stopping the processes of {pods} pod(s) ({containers}): SIGTERM, SIGKILL after "
            f"{self._stop_grace():g} s{why}"
        )
        failpoints.reach("stopping")

    def _stop_grace(self) -> float:
        """SIGTERM -> SIGKILL grace for the processes being stopped: the job's termination
        grace, bounded by its hang grace when they are stopped because the job hung (a hung
        process cannot save; waiting 900 s for it only stalls the job)."""
        grace = self.recovery.termination_grace_s
        if self.hang_stop:
            grace = min(grace, self.recovery.hang_grace_s)
        return grace

    def _write_fence(self, pods: list[PodRow]) -> None:
        """Fencing: a pod moved off a lost node (hung or cut off, it may still run the old pod)
        gets its new generation written to the fence before it starts; the SDK refuses a
        checkpoint from any older generation of that pod. Pods stopped in order (on nodes that
        answer) are not fenced: their dying gasp is part of the recovery."""
        for pod in pods:
            seen = self._placed.get(pod.idx)
            if seen is not None and seen[0] != pod.generation:
                old = self.store.node(seen[1])
                if old is None or old.state is NodeState.LOST:
                    self._fenced[pod.idx] = max(self._fenced.get(pod.idx, 0), pod.generation)
            self._placed[pod.idx] = (pod.generation, pod.node)
        fence = {"generations": {str(k): v for k, v in sorted(self._fenced.items())}}
        if fence == self._fence:
            return
        path = self._fence_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fence))
        tmp.replace(path)
        self._fence = fence

    def _fence_path(self) -> Path:
        return self.state_dir / "jobs" / str(self.job_id) / "shared" / FENCE_FILE

    def _master_port(self) -> int:
        """A port free on the node of rank 0 (pod 0), for MASTER_PORT."""
        return self.engine.free_port(self._pod(0).node)

    def _assume(self, standby: LauncherLink, pod: PodRow) -> None:
        """The standby launcher on the pod's new node becomes its launcher: its warm spares
        become the pod's processes at the next start."""
        plan = self._launch_plan(pod)
        standby.conn.send({"t": "assume", "plan": asdict(plan)})
        self.engine.assumed(self.job_id, pod.node, pod.idx, pod.generation)
        link = LauncherLink(standby.conn, pod.idx, pod.generation, standby.pid, node=pod.node)
        self.launchers[pod.idx] = link
        membership = self.store.job(self.job_id).membership
        if self.recovery.process_level and membership is not None:
            link.conn.send({"t": "membership", "m": membership})
        self.launching.pop(pod.idx, None)
        self.lost_launchers.pop(pod.idx, None)
        self.event(f"pod {pod.idx} takes the standby launcher on {pod.node} and its warm spares")

    def _standby_nodes(self) -> set[str]:
        """Nodes that keep a standby launcher: with warm spares for a process-level job, every
        schedulable node with a live agent that no pod of the job uses."""
        if not (self.recovery.process_level and self.spec.warm_spares):
            return set()
        return set(self._free_nodes({p.node for p in self.store.pods(self.job_id)}))

    def _free_nodes(self, used: set[str]) -> list[str]:
        """Schedulable nodes with a live agent and chips for a pod that no pod in `used` is on."""
        return [
            n.name
            for n in self.store.nodes()
            if n.schedulable
            and n.name in self.agents
            and n.name not in used
            and n.chips >= self.spec.chips_per_pod
        ]

    def _awaiting_launcher(self) -> set[str]:
        """Nodes where a pod was placed and has no launcher yet (a standby one may become it)."""
        parked = self._parked()
        return {
            p.node
            for p in self.store.pods(self.job_id)
            if p.idx not in self.launchers and p.idx not in parked
        }

    def _keep_standby(self, now: float) -> None:
        """Level-triggered like the pods: one standby launcher per standby node, none elsewhere."""
        job = self.store.job(self.job_id)
        if job.status.ended or now < self.adopt_until:
            return
        wanted = self._standby_nodes()
        for node, link in list(self.standby.items()):
            if node not in wanted and node not in self._awaiting_launcher():
                link.conn.send({"t": "shutdown", "grace": 0})
                del self.standby[node]
        for node in sorted(wanted - set(self.standby)):
            since = self.standby_launching.get(node)
            if since is not None and now - since < 30:
                continue
            self.standby_launching[node] = now
            plan = LaunchPlan(
                job=self.job_id,
                pod=-1,
                generation=0,
                node=node,
                command=list(self.spec.command),
                procs_per_pod=self.spec.procs_per_pod,
                first_rank=0,
                working_dir=self.spec.working_dir,
                monitor_interval_s=self.recovery.monitor_interval_s,
                adopt_grace_s=self.cluster.adopt_grace_s,
                workdir=str(self.state_dir / "jobs" / str(self.job_id) / "standby" / node),
                env=dict(self.spec.env),
                warm_spares=self.spec.warm_spares,
                progress_interval_s=self._progress_interval(),
                standby=True,
            )
            self.engine.start_pod(plan)

    def _teardown_pending(self, idx: int, now: float) -> bool:
        """The pod's old container is still being torn down. By default the replacement waits for
        it; with MA_FAILOVER_TERMINATION_GRACE_PERIOD_SECONDS = N > 0 it waits at most N s and the
        rest of the teardown goes on in the background."""
        leaving = self.tearing_down.get(idx)
        if leaving is None:
            return False
        limit = self.recovery.volume_teardown_grace_s
        if limit is None:
            limit = self.recovery.termination_grace_s + 10.0  # never wait forever for a dead peer
        if leaving[0].conn.closed or now - leaving[1] >= limit:
            del self.tearing_down[idx]
            return False
        return True

    def _check_done(self, now: float) -> None:
        if self.decide_pending:
            return  # a stored fault waits for its decision: the job is not done before it
        job = self.store.job(self.job_id)
        parked = self._parked()
        active = [p.idx for p in self.store.pods(self.job_id) if p.idx not in parked]
        if job.status.ended or any(idx not in self.launchers for idx in active):
            return
        ranks = [
            p
            for idx in active
            for p in self.launchers[idx].procs.values()
            if p.attempt == job.attempt
        ]
        if len(ranks) == len(active) * self.spec.procs_per_pod and all(
            not p.running and p.code == 0 for p in ranks
        ):
            if self.active is not None:
                self.store.settle_record(
                    self.active.record_id,
                    Outcome.SUCCEEDED,
                    resumed_at=now,
                    fault_at=self.active.fault.at,
                )
                self.active = None
            self.store.update_job(
                self.job_id, status=JobStatus.SUCCEEDED, reason="every rank exited 0", ended_at=now
            )
            self.event(f"job {self.spec.name} succeeded")

    # -- pods -------------------------------------------------------------------------------------------

    def _pod(self, idx: int) -> PodRow:
        return next(p for p in self.store.pods(self.job_id) if p.idx == idx)

    def _workdir(self, idx: int, generation: int) -> Path:
        return self.state_dir / "jobs" / str(self.job_id) / "pods" / f"pod-{idx}-g{generation}"

    def _launch_plan(self, pod: PodRow) -> LaunchPlan:
        return LaunchPlan(
            job=self.job_id,
            pod=pod.idx,
            generation=pod.generation,
            node=pod.node,
            command=list(self.spec.command),
            procs_per_pod=self.spec.procs_per_pod,
            first_rank=pod.idx * self.spec.procs_per_pod,
            working_dir=self.spec.working_dir,
            monitor_interval_s=self.recovery.monitor_interval_s,
            adopt_grace_s=self.cluster.adopt_grace_s,
            workdir=pod.workdir,
            env=dict(self.spec.env),
            warm_spares=self.spec.warm_spares if self.recovery.process_level else 0,
            progress_interval_s=self._progress_interval(),
            termination_grace_s=self.recovery.termination_grace_s,
            activity_interval_s=self._activity_interval(),
        )

    def _activity_interval(self) -> float:
        """CPU and I/O samples: five per hang window, between 0.2 s and 30 s apart."""
        return min(30.0, max(0.2, self.hang_s / 5))

    def _progress_interval(self) -> float:
        """20 ms for a small job, longer for a large one: about 500 progress messages a second
        at most, whatever the number of pods (each message carries every rank of its pod)."""
        return max(0.02, 0.002 * self.spec.replicas)

    def _env(self, pod: PodRow, attempt: int) -> dict[str, str]:
        """R-04 to R-07: what every process of the pod sees (RANK and LOCAL_RANK are the launcher's)."""
        job = self.store.job(self.job_id)
        env = {
            "WORLD_SIZE": str(self.spec.world_size),
            "LOCAL_WORLD_SIZE": str(self.spec.procs_per_pod),
            "GROUP_RANK": str(pod.idx),
            "MASTER_ADDR": self.engine.node_address(self._pod(0).node),
            "MASTER_PORT": str(job.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(attempt - 1),
            "MA_SCHEDULE_CNT": str(pod.schedule_cnt),
            "MA_PROC_START_CNT": str(pod.proc_start_cnt),
            "RELAUNCH_JOB": self.spec.name,
            "RELAUNCH_JOB_ID": str(self.job_id),
            "RELAUNCH_POD": str(pod.idx),
            "RELAUNCH_NODE": pod.node,
            "RELAUNCH_ATTEMPT": str(attempt),
            "RELAUNCH_GENERATION": str(pod.generation),
            "RELAUNCH_SHARED_DIR": str(self.state_dir / "jobs" / str(self.job_id) / "shared"),
        }
        env.update(process_recovery_env(self.recovery))
        if self.recovery.process_level:
            env["RELAUNCH_MEMBERSHIP"] = str(Path(pod.workdir) / "membership.json")
            env["RELAUNCH_POD_GENERATION"] = str(pod.generation)
            env["RELAUNCH_RECOVERY_WAIT"] = str(self.recovery.wait_reschedule_timeout_s)
        return env


def _slots(nodes: list[NodeRow], chips_per_pod: int, one_per_node: bool) -> list[str]:
    """Node names, one entry per pod that fits: one pod per node unless a node has chips for more."""
    names: list[str] = []
    for node in nodes:
        if node.chips < chips_per_pod:
            continue
        fits = node.chips // chips_per_pod if chips_per_pod else 1
        names.extend([node.name] * (1 if one_per_node else max(1, fits)))
    return names


def create_pods(store: Store, state_dir: Path, job_id: int, spec: JobSpec) -> list[PodRow]:
    """Place a new job's pods in order on the first Ready nodes with chips for them."""
    capacity = _slots(
        [n for n in store.nodes() if n.schedulable], spec.chips_per_pod, one_per_node=False
    )
    if len(capacity) < spec.replicas:
        raise RuntimeError(
            f"job {spec.name} needs {spec.replicas} pod(s) with {spec.chips_per_pod} chip(s) each; "
            f"the cluster has room for {len(capacity)} on Ready nodes (see `relaunch nodes`)"
        )
    pods = []
    for idx in range(spec.replicas):
        workdir = state_dir / "jobs" / str(job_id) / "pods" / f"pod-{idx}-g1"
        pod = PodRow(job_id, idx, capacity[idx], 1, 1, 1, str(workdir))
        store.put_pod(pod)
        pods.append(pod)
    return pods
