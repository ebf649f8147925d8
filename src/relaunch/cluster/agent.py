"""The node agent of the embedded cluster: one process per simulated node.

It connects to the controller, says which node it is, and sends a heartbeat every interval with the
health of its chips and its network link. Its chips are real GPUs, read through NVML at each
heartbeat (relaunch.cluster.nvml), where this machine has them (`--first-gpu`: which ones);
simulated otherwise. A chip fault or a link going down is set by the fault plan (through the
controller); a chip fault and its heal go in a heartbeat sent at once (a GPU's fault in the next
one; a heartbeat whose chips changed rings the controller's doorbell), as a device plugin would
report it. Killing the agent is how a node is lost; a stopped (SIGSTOP) agent stops answering
too. Without a controller it exits after the grace period.

Where pods are cgroups (`--cgroups`, see relaunch.containers), the agent is also what a kubelet
is to a container: at every beat it looks at the pods on its node, and a pod whose launcher has
died is killed whole (its ranks, all they started) and its cgroups removed, with a controller or
without one.

Where nodes are network namespaces (`--network`, see relaunch.cluster.network), the agent
watches its node's data link (`cluster.linkwatch`): its carrier, and whether the neighbouring nodes
answer a probe on each link. A lost carrier, or neighbours that answer on the management link
but not on the data link (the node is cut from its peers), is the link down: said at once in
every heartbeat (`link_down`), reported as a fault once down for the blip window (R-12), and with
its duration once it is back. The fault plan does not say so: the agent sees it.

An agent on a machine of its own (`--hosts-pods`: started by a Slurm step, or by hand with
`relaunch agent --controller HOST:PORT`) also starts its node's pods when the controller sends it
their plans (`cluster.podhost`), says the node's address and a free port with its hello and its
heartbeats (MASTER_ADDR and MASTER_PORT where rank 0 is there), and kills its pods when told the
node crashes (`Crash`, the fault plan's node-down) or when the job ends.

Run as `python -m relaunch.cluster.agent`, or `relaunch agent`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from relaunch.cluster.keeper import PeerMemoryServer
from relaunch.cluster.linkwatch import LinkWatch
from relaunch.cluster.network import ClusterNetwork
from relaunch.cluster.nvml import NvmlChips, open_gpus
from relaunch.cluster.podhost import PodHost
from relaunch.containers import Cgroup, ClusterCgroups, reap_pods, step_out
from relaunch.faults.gpu_codes import PERSISTENT, GpuReading, gpu_fault_codes, most_serious
from relaunch.protocol.layout import StateDir
from relaunch.protocol.messages import (
    AgentHello,
    ChipReport,
    Crash,
    ForgetCopies,
    Heal,
    Healed,
    Heartbeat,
    InjectChipFault,
    InjectCopyCorruption,
    Injected,
    InjectNetworkFault,
    LinkReport,
    Message,
    Shutdown,
    StartPod,
)
from relaunch.protocol.wire import Connection, controller_address, write_controller_address
from relaunch.train.local import forget_job


@dataclass
class LinkDown:
    """A simulated link fault: down since `at`, for the `duration_s` the plan gave."""

    seq: int
    at: float
    duration_s: float | None
    heals: bool


class Agent:
    def __init__(
        self,
        state_dir: Path,
        node: str,
        chips: int,
        interval: float,
        grace: float,
        blip_s: float,
        gpus: NvmlChips | None = None,
        cgroups: ClusterCgroups | None = None,
        watch: LinkWatch | None = None,
        host: PodHost | None = None,
        controller: tuple[str, int] | None = None,
        address: str = "",
        peer_memory: PeerMemoryServer | None = None,
    ) -> None:
        self.host = host
        """Where the agent starts its node's pods itself (see the module docstring)."""
        self.peer_memory = peer_memory
        """Where the node keeps other nodes' checkpoint copies (None: nowhere)."""
        self.stays = False
        """The agent is its node's kubelet (cluster.kubernetes.kubelet): it outlives the jobs
        it runs pods for, and waits for the next controller instead of exiting."""
        if host is not None and host.cgroups is not None:
            cgroups = host.cgroups
        self.controller = controller
        """The controller's address as given (`--controller`); None: the state directory's."""
        self.address = address
        self.gpus = gpus
        self.watch = watch
        self.cgroups = cgroups
        self.launchers_seen: set[Path] = set()
        """Pods whose launcher this agent saw alive (see containers.reap_pods)."""
        self.gpu_looks: dict[int, GpuReading] = {}
        self.state_dir = state_dir
        self.node = node
        self.chips = chips
        self.interval = interval
        self.grace = grace
        self.blip_s = blip_s
        self.faults: dict[int, ChipReport] = {}
        self.link: LinkDown | None = None
        """A simulated link fault (the fault plan's, where nodes share the loopback)."""
        self.outages: dict[tuple[str, float], int] = {}
        """The seen outages under way (cause, since) and their `seq`."""
        self.ended_links: list[LinkReport] = []
        """Seen outages that ended and were not reported yet (one a beat)."""
        self.seq = 0
        self.sent_chips: tuple[int, ...] = ()
        """The chip faults (their `seq`) the last heartbeat carried."""
        self.sent_down = False
        """Whether the last heartbeat said the data link is down."""
        self.lock = threading.Lock()
        self.forgetting: list[threading.Thread] = []
        """Removals of ended jobs' copies from the node's disk (ForgetCopies), each a thread."""

    def heartbeat(self) -> Heartbeat:
        now = time.time()
        readings = self.gpus.look() if self.gpus is not None else []
        if self.watch is not None:
            self.watch.look(now)
        with self.lock:
            for reading in readings:
                self._gpu_fault(reading, now)
            link = self._seen_link(now) if self.watch is not None else None
            if link is None and self.link is not None:
                link = self._simulated_link(now)
            down = self.link is not None or (
                self.watch is not None and self.watch.current() is not None
            )
            chips = tuple(self.faults.values())
            rtt = self.watch.rtt_ms() if self.watch is not None else None
            port = self.host.free_port() if self.host is not None else 0
            return Heartbeat(
                self.node, now, chips, link, link_down=down, data_rtt_ms=rtt, free_port=port
            )

    def _seen_link(self, now: float) -> LinkReport | None:
        """What the link watch saw: an outage that ended (with its duration), or one under way
        longer than the blip window (R-12). One a beat; the others wait for the next ones. Each
        outage keeps one `seq` from its start to its end."""
        assert self.watch is not None
        for cause, since, duration in self.watch.take_ended():
            seq = self.outages.pop((cause, since), None)
            if seq is None:
                self.seq += 1
                seq = self.seq
            self.ended_links.append(LinkReport(seq, since, round(duration, 3), cause))
        if self.ended_links:
            return self.ended_links.pop(0)
        current = self.watch.current()
        if current is None:
            return None
        cause, since = current
        if (cause, since) not in self.outages:
            self.seq += 1
            self.outages[(cause, since)] = self.seq
        if now - since <= self.blip_s:
            return None
        return LinkReport(self.outages[(cause, since)], since, None, cause)

    def _simulated_link(self, now: float) -> LinkReport | None:
        """A simulated link fault (a fault plan's, on the shared loopback): back after the
        duration the plan gave."""
        assert self.link is not None
        down_for = now - self.link.at
        restored = self.link.duration_s is not None and down_for >= self.link.duration_s
        report = None
        if restored or down_for > self.blip_s:
            duration = self.link.duration_s if restored else None
            report = LinkReport(self.link.seq, self.link.at, duration)
        if restored:
            self.link = None
        return report

    def beat(self, conn: Connection) -> bool:
        """Send a heartbeat; one whose chip faults differ from the last one's (a fault came or
        healed), or that reports a link fault or a change of the link, rings the controller's
        doorbell, so that it is acted on now, not at its next read."""
        heartbeat = self.heartbeat()
        chips = tuple(chip.seq for chip in heartbeat.chips)
        with self.lock:
            news = chips != self.sent_chips or heartbeat.link_down != self.sent_down
            self.sent_chips, self.sent_down = chips, heartbeat.link_down
        return conn.send(heartbeat, urgent=news or heartbeat.link is not None)

    def _gpu_fault(self, reading: GpuReading, now: float) -> None:
        """A real GPU's look as its chip's fault: a new Xid or ECC event each time; a condition
        (lost, remap pending or failed) once while it holds, and cleared when it no longer does."""
        chip = reading.index
        code = most_serious(gpu_fault_codes(self.gpu_looks.get(chip), reading))
        self.gpu_looks[chip] = reading
        current = self.faults.get(chip)
        if current is not None and current.code in PERSISTENT and current.code != code:
            del self.faults[chip]  # the GPU was reset or replaced: the condition is gone
            current = None
        if code is None or (current is not None and current.code == code and code in PERSISTENT):
            return
        self.seq += 1
        self.faults[chip] = ChipReport(self.seq, chip, code, code not in PERSISTENT, "chip", now)

    def handle(self, conn: Connection, message: Message) -> None:
        with self.lock:
            match message:
                case InjectChipFault(index=index, chip=chip):
                    if not 0 <= chip < self.chips:  # never wrapped onto another chip
                        why = (
                            f"node {self.node} has {self.chips} chip(s); chip {chip} does not exist"
                        )
                        conn.send(Injected(index, False, why, time.time()))
                        return
                    self.seq += 1
                    self.faults[chip] = ChipReport(
                        self.seq, chip, message.code, message.heals, message.kind, time.time()
                    )
                    conn.send(Injected(index, True, "", time.time()))
                case InjectNetworkFault(index=index):
                    self.seq += 1
                    self.link = LinkDown(self.seq, time.time(), message.duration_s, message.heals)
                    conn.send(Injected(index, True, "", time.time()))
                case InjectCopyCorruption(index=index, job=job):
                    if self.peer_memory is None:
                        why = f"node {self.node} keeps no peer memory"
                        conn.send(Injected(index, False, why, time.time()))
                        return
                    spoiled = self.peer_memory.memory.go_bad(job)
                    print(f"agent {self.node}: peer memory of job {job} gone bad ({spoiled} "
                          "copies held spoiled, every later one too)", flush=True)  # fmt: skip
                    conn.send(Injected(index, True, "", time.time()))
                case Heal(request=request):
                    conn.send(Healed(request, self.node, self._heal()))

    def _heal(self) -> bool:
        """Clear every fault that heals; True if nothing is left faulty."""
        ok = True
        for chip, fault in list(self.faults.items()):
            if fault.heals:
                del self.faults[chip]
            else:
                ok = False
        if self.watch is not None and self.watch.current() is not None:
            ok = False  # a real link heals when it comes back, not when asked
        if self.link is not None:
            ok = ok and self.link.heals
            if self.link.heals:
                self.link = None
        return ok

    def forget(self, directory: str, job: int) -> None:
        """An ended job's copies on this node's disk (under its local checkpoint directory)."""
        if directory and forget_job(directory, self.node, job):
            print(f"agent {self.node}: removed job {job}'s local checkpoint copies", flush=True)

    def forget_all(self, copies: tuple[tuple[str, int], ...]) -> None:
        """Other ended jobs' copies on this node's disk (ForgetCopies), each (directory, job)."""
        for directory, job in copies:
            self.forget(directory, job)

    def reap(self) -> None:
        """Kill the pods on this node whose launcher died (see the module docstring)."""
        if self.cgroups is None:
            return
        killed = reap_pods(self.cgroups, self.node, self.launchers_seen)
        if killed:
            print(
                f"agent {self.node}: killed {killed} process(es) of pods whose launcher died",
                flush=True,
            )

    def run(self) -> None:
        threading.Thread(target=self.reap_loop, daemon=True).start()
        try:
            self.serve()
        finally:
            self.reap()
            if self.cgroups is not None:  # its own cgroup, and the node's if empty
                step_out(self.cgroups.agent(self.node), levels=1)
            network = ClusterNetwork.existing(self.state_dir) if self.watch is not None else None
            if network is not None:  # its namespace, and the switch's with the last node's
                with contextlib.suppress(OSError):
                    network.step_out(self.node)

    def reap_loop(self) -> None:
        while True:
            time.sleep(self.interval)
            self.reap()

    def hello(self, conn: Connection) -> AgentHello:
        address = self.address or conn.local_address()
        memory = ""
        if self.peer_memory is not None:
            host, port = self.peer_memory.address
            memory = f"{address if host == '0.0.0.0' else host}:{port}"
        if self.host is None:
            return AgentHello(self.node, self.chips, peer_memory=memory)
        return AgentHello(self.node, self.chips, True, address, self.host.free_port(), memory)

    def hosted(self, message: Message) -> None:
        """What the controller asks of an agent that hosts its node's pods."""
        assert self.host is not None
        match message:
            case StartPod(plan=plan):
                self.host.start(plan)
            case Crash():
                self.host.crash()
                os._exit(1)

    def serve(self) -> None:
        alone_since = time.time()
        while True:
            # the state directory's first: a resumed controller listens on a port of its own
            address = controller_address(self.state_dir) or self.controller
            conn = None
            if address is not None:
                try:
                    conn = Connection.connect(*address)
                except OSError:
                    conn = None
            if conn is not None and conn.send(self.hello(conn)):
                done = threading.Event()

                def read(c: Connection = conn, done: threading.Event = done) -> None:
                    for message in c:
                        if isinstance(message, Shutdown):
                            for forgetting in self.forgetting:  # the job's end: copies go first
                                forgetting.join()
                            if self.host is not None:
                                left = self.host.end()
                                print(f"agent {self.node}: the pods left {left} process(es)")
                            if not self.stays:
                                os._exit(0)
                            with contextlib.suppress(OSError):  # the next job's, when it comes
                                StateDir(self.state_dir).controller_address.unlink()
                            c.close()
                            break
                        if isinstance(message, ForgetCopies):  # beats, pod starts go on
                            forget = functools.partial(self.forget_all, message.copies)
                            self.forgetting.append(threading.Thread(target=forget, daemon=True))
                            self.forgetting[-1].start()
                            continue
                        if isinstance(message, StartPod | Crash) and self.host is not None:
                            self.hosted(message)
                            continue
                        self.handle(c, message)
                        if isinstance(message, InjectChipFault | Heal):
                            self.beat(c)  # a chip failed or healed: said at once
                    done.set()

                threading.Thread(target=read, daemon=True).start()
                while not done.is_set() and self.beat(conn):
                    if self.watch is not None:
                        self.watch.probe()
                    done.wait(self.interval)
                conn.close()
                alone_since = time.time()
            if time.time() - alone_since > self.grace and not self.stays:
                return
            time.sleep(0.1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relaunch.cluster.agent")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--chips", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--blip", type=float, default=20.0)
    parser.add_argument(
        "--first-gpu", type=int, default=0, help="this node's chip 0 is this machine's GPU N"
    )
    parser.add_argument(
        "--simulate-chips", action="store_true", help="simulated chips even where NVML sees GPUs"
    )
    parser.add_argument("--cgroups", type=Path, help="the cluster's cgroup: pods are cgroups")
    parser.add_argument(
        "--network", action="store_true", help="the node is a network namespace: watch its links"
    )
    parser.add_argument(
        "--hosts-pods", action="store_true", help="start this node's pods when the controller asks"
    )
    parser.add_argument(
        "--controller", type=controller_argument, help="HOST:PORT (default: the state directory's)"
    )
    parser.add_argument("--address", default="", help="the node's address for its peers")
    parser.add_argument(
        "--kubeconfig", type=Path, help="be this node's kubelet on that Kubernetes API server"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    gpus, why = (None, "simulated (--simulate-chips)")
    if not args.simulate_chips and args.chips > 0:
        gpus, why = open_gpus(args.first_gpu, args.chips)
    print(f"agent {args.node}: {args.chips} chip(s): {why}", flush=True)
    cgroups = ClusterCgroups(Cgroup(args.cgroups)) if args.cgroups is not None else None
    watch = LinkWatch(args.state_dir, args.node, args.interval) if args.network else None
    host = None
    if args.hosts_pods or args.kubeconfig is not None:
        args.state_dir.mkdir(parents=True, exist_ok=True)
        host = PodHost(args.state_dir, args.node)
        print(f"agent {args.node}: pods are {host.containers}", flush=True)
        if args.controller is not None and controller_address(args.state_dir) is None:
            # this machine's launchers find the controller where the agent was told it is
            controller_host, controller_port = args.controller
            write_controller_address(args.state_dir, controller_host, controller_port, pid=0)
    agent = Agent(
        args.state_dir,
        args.node,
        args.chips,
        args.interval,
        args.grace,
        args.blip,
        gpus,
        cgroups,
        watch,
        host,
        args.controller,
        args.address,
        _peer_memory(args.state_dir, args.node, args.network, host is not None),
    )
    if args.kubeconfig is not None:
        _be_kubelet(agent, args, gpus is not None)
    if host is not None:
        where = "{}:{}".format(*args.controller) if args.controller else "its state directory's"
        print(f"agent {args.node}: ready; the controller is at {where}", flush=True)
    agent.run()


def _be_kubelet(agent: Agent, args: argparse.Namespace, gpus: bool) -> None:
    """`--kubeconfig`: the agent is its node's kubelet (cluster.kubernetes.kubelet)."""
    from relaunch.cluster.kubernetes.kubelet import NodeKubelet  # the `kubernetes` extra

    assert agent.host is not None
    agent.stays = True
    kubelet = NodeKubelet(
        args.kubeconfig, args.node, args.chips, gpus, args.address, args.state_dir, agent.host
    )
    kubelet.start()
    print(f"agent {args.node}: registered with Kubernetes as node {args.node}", flush=True)


def _peer_memory(state_dir: Path, node: str, network: bool, hosted: bool) -> PeerMemoryServer:
    """The node's peer memory, listening on its data link: the data address where the node is a
    network namespace, every address where it is a machine of its own, else the loopback."""
    layout = ClusterNetwork.existing(state_dir) if network else None
    if layout is not None:
        host = layout.layout.data_address(node)
    else:
        host = "0.0.0.0" if hosted else "127.0.0.1"
    return PeerMemoryServer(host).start()


def controller_argument(text: str) -> tuple[str, int]:
    """HOST:PORT, as `relaunch agent --controller` takes it."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: give the controller as HOST:PORT")
    return host.strip("[]"), int(port)


if __name__ == "__main__":
    main()
