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
watches its node's data link (`LinkWatch`): its carrier, and whether the neighbouring nodes
answer a probe on each link. A lost carrier, or neighbours that answer on the management link
but not on the data link (the node is cut from its peers), is the link down: said at once in
every heartbeat (`link_down`), reported as a fault once down for the blip window (R-12), and with
its duration once it is back. The fault plan does not say so: the agent sees it.

Run as `python -m relaunch.cluster.agent`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from relaunch.cluster.network import DATA_IF, PROBE_PORT, ClusterNetwork, Layout
from relaunch.cluster.nvml import NvmlChips, open_gpus
from relaunch.containers import Cgroup, ClusterCgroups, reap_pods, step_out
from relaunch.faults.gpu_codes import PERSISTENT, GpuReading, gpu_fault_codes, most_serious
from relaunch.protocol.messages import (
    AgentHello,
    ChipReport,
    Heal,
    Healed,
    Heartbeat,
    InjectChipFault,
    Injected,
    InjectNetworkFault,
    LinkReport,
    Message,
    Shutdown,
)
from relaunch.protocol.wire import Connection, controller_address


@dataclass
class LinkDown:
    """A simulated link fault: down since `at`, for the `duration_s` the plan gave."""

    seq: int
    at: float
    duration_s: float | None
    heals: bool


_SIOCGIFFLAGS = 0x8913
_IFF_RUNNING = 0x40
_RTMGRP_LINK = 1
_RTM_NEWLINK = 16
_NLMSG_HEADER = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BxHiII")
_PROBE, _ANSWER = b"relaunch-probe", b"relaunch-answer"
_CARRIER_LOST = "carrier lost"
_PEERS_SILENT = "its peers do not answer on the data link (they do on the management link)"
RTT_SAMPLES = 10
"""How many of the latest answers of each neighbour on the data link its round trip is taken
from: their 90th percentile (a degraded link delays most probes that queue behind the ranks'
traffic, not all of them)."""


def carrier(interface: str) -> bool:
    """Whether `interface` (in this process's network namespace) is up and has its carrier."""
    request = struct.pack("16sH14x", interface.encode(), 0)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request)
    except OSError:
        return False  # no such interface: no link
    return bool(struct.unpack("16sH14x", answer)[1] & _IFF_RUNNING)


class LinkWatch:
    """What an agent sees of its node's data link, and when:

    - its carrier, from the kernel's link notifications (rtnetlink): a flap shorter than a
      heartbeat is seen, with its start and end to the notification;
    - whether its neighbours (the next nodes in the layout) answer a probe on each link, each
      beat. Cut from its peers: some neighbour answers on the management link, none on the data
      link (three nodes or more tell which one is cut; two cut from each other both say so);
    - the round trip of those probes on the data link (a degraded link queues them).

    An outage is current while it lasts (`current`) and ended once it is over (`take_ended`)."""

    def __init__(self, state_dir: Path, node: str, interval: float) -> None:
        self.path = state_dir / "network.json"
        self.node = node
        self.window = max(3 * interval, 0.6)
        self.layout: Layout | None = None
        self.read_at = 0.0
        self.heard: dict[str, float] = {}
        """Address -> when it last answered."""
        self.rtts: dict[str, list[float]] = {}
        """Each neighbour's latest round trips on the data link, seconds."""
        self.started = time.time()
        self.lock = threading.Lock()
        self.down_since: dict[str, float] = {}
        """Cause -> since when (the outage under way of each kind)."""
        self.ended: list[tuple[str, float, float]] = []
        """(cause, from, seconds) of outages over since the last look."""
        self.carrier_back_at = 0.0
        """When the carrier last came back: the peers are judged a window later."""
        self.index = socket.if_nametoindex(DATA_IF)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", PROBE_PORT))
        threading.Thread(target=self._answer, name="relaunch-link-probes", daemon=True).start()
        self.netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.netlink.bind((0, _RTMGRP_LINK))
        self._carrier(carrier(DATA_IF), time.time())
        threading.Thread(target=self._notified, name="relaunch-link-events", daemon=True).start()

    # -- the carrier --------------------------------------------------------------------------

    def _notified(self) -> None:
        """The kernel's word on every change of a link of this namespace."""
        while True:
            try:
                data = self.netlink.recv(65536)
            except OSError:
                return
            at, offset = time.time(), 0
            while offset + _NLMSG_HEADER.size <= len(data):
                length, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, offset)
                if length < _NLMSG_HEADER.size:
                    break
                body = offset + _NLMSG_HEADER.size
                if kind == _RTM_NEWLINK and body + _IFINFOMSG.size <= len(data):
                    _, _, index, flags, _ = _IFINFOMSG.unpack_from(data, body)
                    if index == self.index:
                        self._carrier(bool(flags & _IFF_RUNNING), at)
                offset += (length + 3) & ~3

    def _carrier(self, running: bool, at: float) -> None:
        self._state(_CARRIER_LOST, not running, at)

    def _state(self, cause: str, down: bool, at: float) -> None:
        with self.lock:
            since = self.down_since.get(cause)
            if down and since is None:
                self.down_since[cause] = at
            elif not down and since is not None:
                del self.down_since[cause]
                self.ended.append((cause, since, max(0.0, at - since)))

    # -- the peers ----------------------------------------------------------------------------

    def _neighbours(self) -> list[tuple[str, str]]:
        """(management, data) addresses of the nodes this one probes; the layout re-read when
        it changed (nodes join it as their agents start)."""
        with contextlib.suppress(OSError):
            changed = self.path.stat().st_mtime
            if changed != self.read_at:
                self.layout = Layout.read(self.path) or self.layout
                self.read_at = changed
        layout = self.layout
        if layout is None or self.node not in layout.nodes:
            return []
        return [
            (layout.mgmt_address(n), layout.data_address(n)) for n in layout.neighbours(self.node)
        ]

    def probe(self) -> None:
        payload = _PROBE + f" {time.time():.6f}".encode()
        for addresses in self._neighbours():
            for address in addresses:
                with contextlib.suppress(OSError):  # a cut route refuses the send: no answer
                    self.sock.sendto(payload, (address, PROBE_PORT))

    def _answer(self) -> None:
        data_net = self.layout.data if self.layout is not None else None
        while True:
            try:
                data, source = self.sock.recvfrom(64)
            except OSError:
                return
            kind, _, sent = data.partition(b" ")
            now = time.time()
            if kind == _PROBE:
                with contextlib.suppress(OSError):
                    self.sock.sendto(_ANSWER + b" " + sent, source)
            elif kind == _ANSWER:
                self.heard[source[0]] = now
                data_net = self.layout.data if self.layout is not None else data_net
                if data_net is not None and source[0].startswith(f"10.{data_net}."):
                    with contextlib.suppress(ValueError), self.lock:
                        kept = self.rtts.get(source[0], [])[-(RTT_SAMPLES - 1) :]
                        self.rtts[source[0]] = [*kept, now - float(sent)]

    # -- what the heartbeat says --------------------------------------------------------------

    def look(self, now: float) -> None:
        """The beat's look: the carrier read again (a notification the socket dropped is not
        missed for long), and whether the neighbours answer."""
        self._carrier(carrier(DATA_IF), now)
        with self.lock:
            carrier_since = self.down_since.get(_CARRIER_LOST)
            back_at = max((at + d for c, at, d in self.ended if c == _CARRIER_LOST), default=0.0)
        self.carrier_back_at = max(self.carrier_back_at, back_at)
        if carrier_since is not None or now - max(self.started, self.carrier_back_at) < self.window:
            return  # no carrier (that is the outage), or no answer could have come back yet
        neighbours = self._neighbours()

        def answered(address: str) -> bool:
            return now - self.heard.get(address, 0.0) <= self.window

        cut = any(answered(m) for m, _ in neighbours) and not any(
            answered(d) for _, d in neighbours
        )
        self._state(_PEERS_SILENT, cut, now)

    def current(self) -> tuple[str, float] | None:
        """The outage under way (the carrier's first), and since when; None: the link is up."""
        with self.lock:
            for cause in (_CARRIER_LOST, _PEERS_SILENT):
                if cause in self.down_since:
                    return cause, self.down_since[cause]
        return None

    def take_ended(self) -> list[tuple[str, float, float]]:
        with self.lock:
            ended, self.ended = self.ended, []
        return ended

    def rtt_ms(self) -> float | None:
        """This node's data-link round trip, milliseconds: the median over its neighbours of the
        90th percentile of each one's latest answers. A slow link of this node delays them all;
        a neighbour's slow link, only that neighbour's."""
        with self.lock:
            each = [sorted(rtts)[int(len(rtts) * 0.9)] for rtts in self.rtts.values() if rtts]
        if not each:
            return None
        each.sort()
        return round(each[len(each) // 2] * 1000, 3)


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
    ) -> None:
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
            return Heartbeat(self.node, now, chips, link, link_down=down, data_rtt_ms=rtt)

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

    def serve(self) -> None:
        alone_since = time.time()
        while True:
            address = controller_address(self.state_dir)
            conn = None
            if address is not None:
                try:
                    conn = Connection.connect(*address)
                except OSError:
                    conn = None
            if conn is not None and conn.send(AgentHello(self.node, self.chips)):
                done = threading.Event()

                def read(c: Connection = conn, done: threading.Event = done) -> None:
                    for message in c:
                        if isinstance(message, Shutdown):
                            os._exit(0)
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
            if time.time() - alone_since > self.grace:
                return
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
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
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    gpus, why = (None, "simulated (--simulate-chips)")
    if not args.simulate_chips and args.chips > 0:
        gpus, why = open_gpus(args.first_gpu, args.chips)
    print(f"agent {args.node}: {args.chips} chip(s): {why}", flush=True)
    cgroups = ClusterCgroups(Cgroup(args.cgroups)) if args.cgroups is not None else None
    watch = LinkWatch(args.state_dir, args.node, args.interval) if args.network else None
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
    )
    agent.run()


if __name__ == "__main__":
    main()
