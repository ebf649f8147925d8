"""What a node's agent sees of its node's data link, on a node that is a network namespace of its
own (cluster.network): its carrier, from the kernel's link notifications; whether its
neighbours answer probes on each link; and the data link's round trip (a degraded link queues
the probes). The agent reports what it saw in its heartbeats (R-12: the plan does not declare a
link fault, the agent observes it)."""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import threading
import time
from pathlib import Path

from relaunch.cluster.network import DATA_IF, PROBE_PORT, Layout

__all__ = ["RTT_SAMPLES", "LinkWatch", "carrier", "still_cut"]

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


def still_cut(was_cut: bool, data_answers: bool, management_answers: bool) -> bool:
    """Whether a node is cut from its peers after a beat's look: an answer on the data link ends a
    cut, one on the management link alone starts it; with no answer on either (a loaded machine
    answers late on both) nothing is known, and what was stays (a partition is not cut in two)."""
    if data_answers:
        return False
    return True if management_answers else was_cut


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
        with self.lock:
            self._state(_CARRIER_LOST, not running, at)

    def _state(self, cause: str, down: bool, at: float) -> None:
        """An outage of `cause` starts or ends at `at`; the caller holds the lock."""
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
        missed for long), and whether the neighbours answer. The carrier is read under the lock:
        read before a notification that it came back and kept after it, it would open a second
        outage."""
        with self.lock:
            self._state(_CARRIER_LOST, not carrier(DATA_IF), now)
            carrier_since = self.down_since.get(_CARRIER_LOST)
            back_at = max((at + d for c, at, d in self.ended if c == _CARRIER_LOST), default=0.0)
        self.carrier_back_at = max(self.carrier_back_at, back_at)
        if carrier_since is not None or now - max(self.started, self.carrier_back_at) < self.window:
            return  # no carrier (that is the outage), or no answer could have come back yet
        neighbours = self._neighbours()

        def answered(address: str) -> bool:
            return now - self.heard.get(address, 0.0) <= self.window

        with self.lock:
            cut = still_cut(
                _PEERS_SILENT in self.down_since,
                data_answers=any(answered(d) for _, d in neighbours),
                management_answers=any(answered(m) for m, _ in neighbours),
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
