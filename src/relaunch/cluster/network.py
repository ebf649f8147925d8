"""Real networks for the embedded cluster: each node a network namespace with two links.

    root namespace: the controller        switch namespace rl<D>sw          node i: rl<D>n<i>
      rl<D>c 10.M.0.1/16 ── veth ── c0 ─┐
                                        bridge mgmt ── m<i> ───── veth ───── mgmt0 10.M.x.y/16
                                        bridge data ── d<i> ───── veth ───── data0 10.A.x.y/16

The *management* link carries what the node's agent and launchers say to the controller; the
*data* link what the ranks say to each other (MASTER_ADDR is rank 0's node's data address; gloo
and NCCL are told to bind `data0`). A fault on one leaves the other up, as a RoCE link going down
leaves a node's management network: the agent sees its data link go and says so at once. The
bridges live in a namespace of their own, so that deleting it takes every link of the cluster
with it (the root namespace's end of the controller's link included); a node's namespace lives
while a process runs in it.

Faults are real: a link down is its switch port set down (the node's `data0` loses its carrier);
a partition is blackhole routes (`ip route add blackhole ADDR`: no netfilter needed), from the
controller only (the management addresses both ways), from the node's peers only (the data
addresses both ways) or both; a degraded link is a token bucket (`tc qdisc ... tbf`) on both
directions of the data link. Each is applied and, after its duration, undone by a helper process
(`python -m relaunch.cluster.linkfault`), so that the controller's loop never waits for `ip` and a
flap ends even if the controller dies.

Where namespaces cannot be made (not root, no `ip`, `RELAUNCH_NETWORK=loopback`), the cluster's
nodes share the machine's loopback as before, and `ClusterNetwork.probe` says why.

Names: D is a digest of the state directory (one cluster per state directory, as for cgroups);
the layout (which node has which index, the two /16 prefixes) is kept in the state directory's
`network.json`, so that a resumed controller and the agents find the same network.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

from relaunch.protocol.links import Cut, LinkFaultKind

__all__ = [
    "DATA_IF",
    "MGMT_IF",
    "NETWORK_ENV",
    "PROBE_PORT",
    "ClusterNetwork",
    "Layout",
    "NamespaceGone",
    "enter_namespace",
]

_T = TypeVar("_T")

NETWORK_ENV: Final = "RELAUNCH_NETWORK"
"""`loopback`: the nodes share the machine's loopback even where namespaces could be made."""
MGMT_IF: Final = "mgmt0"
DATA_IF: Final = "data0"
PROBE_PORT: Final = 29471
"""Where each node's agent answers its peers' probes, on both links (see cluster.agent)."""
NETNS_DIR: Final = Path("/run/netns")
MACHINE_LOCK: Final = Path("/run/relaunch-networks.lock")
_CLONE_NEWNET: Final = 0x40000000


class NamespaceGone(FileNotFoundError):
    """A node's namespace that is no longer there (its agent deleted it on its way out)."""


def _host(prefix: int, index: int) -> str:
    """Node `index`'s address in 10.prefix.0.0/16 (.0.1 is the controller's)."""
    number = index + 2
    return f"10.{prefix}.{number >> 8}.{number & 255}"


@dataclass
class Layout:
    """Which node has which index and the cluster's two /16 prefixes (`network.json`)."""

    digest: str
    mgmt: int
    data: int
    nodes: dict[str, int] = field(default_factory=dict)

    @property
    def switch(self) -> str:
        return f"rl{self.digest}sw"

    @property
    def controller_link(self) -> str:
        return f"rl{self.digest}c"

    @property
    def controller_address(self) -> str:
        return f"10.{self.mgmt}.0.1"

    def namespace(self, node: str) -> str:
        return f"rl{self.digest}n{self.nodes[node]}"

    def mgmt_address(self, node: str) -> str:
        return _host(self.mgmt, self.nodes[node])

    def data_address(self, node: str) -> str:
        return _host(self.data, self.nodes[node])

    def neighbours(self, node: str, count: int = 3) -> list[str]:
        """The nodes after `node` in index order, wrapping (whom its agent probes)."""
        ordered = sorted(self.nodes, key=self.nodes.__getitem__)
        at = ordered.index(node)
        others = ordered[at + 1 :] + ordered[:at]
        return others[:count]

    def to_json(self) -> str:
        return json.dumps(
            {"digest": self.digest, "mgmt": self.mgmt, "data": self.data, "nodes": self.nodes}
        )

    @classmethod
    def read(cls, path: Path) -> Layout | None:
        try:
            raw = json.loads(path.read_text())
            return cls(str(raw["digest"]), int(raw["mgmt"]), int(raw["data"]), dict(raw["nodes"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _used_prefixes(route_table: str | None = None) -> set[int]:
    """The second octets of 10.x.0.0/16 networks that a route of the root namespace reaches
    (the default route excepted: a more specific route of ours wins over it)."""
    if route_table is None:
        try:
            route_table = Path("/proc/net/route").read_text()
        except OSError:
            return set()
    used: set[int] = set()
    for line in route_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        destination = int.from_bytes(int(fields[1], 16).to_bytes(4, "little"), "big")
        mask = int.from_bytes(int(fields[7], 16).to_bytes(4, "little"), "big")
        if mask == 0:
            continue
        for second in range(256):
            network = (10 << 24) | (second << 16)
            common = mask & 0xFFFF0000
            if destination & common == network & common:
                used.add(second)
    return used


def new_layout(state_dir: Path, nodes: dict[str, int] | None = None) -> Layout:
    """A layout for the cluster of `state_dir`: prefixes from its digest, the management one
    clear of every network the root namespace routes (the data one is seen by no one else).
    Chosen under `_machine_lock` with the controller's link made before it is let go: two
    clusters started at once each see the other's route (they once shared a prefix)."""
    digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()
    used = _used_prefixes()
    start = int(digest[:4], 16)
    candidates = [64 + (start + i) % 190 for i in range(190)]
    mgmt = next((p for p in candidates if p not in used), candidates[0])
    data = next(p for p in candidates if p != mgmt)
    return Layout(digest[:8], mgmt, data, dict(nodes or {}))


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """One cluster at a time on this machine picks its management prefix and makes its link."""
    with open(MACHINE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ip(
    namespace: str | None, commands: Iterable[str], tool: str = "ip", check: bool = True
) -> None:
    """Run `ip` (or `tc`) commands in one process, in `namespace` (None: the root one); each
    runs even if one before it failed, and a failure raises (unless `check` is False)."""
    lines = "\n".join(commands)
    if not lines:
        return
    args = [tool, *(["-n", namespace] if namespace else []), "-force", "-batch", "-"]
    done = subprocess.run(args, input=lines, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and check:
        raise OSError(f"{tool} failed: {done.stderr.strip() or done.stdout.strip()}")


def _namespace_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def enter_namespace(fd: int) -> None:
    """Move the calling thread into the network namespace open at `fd` (in a child before exec:
    the process and all it starts live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


class ClusterNetwork:
    """The namespaces and links of one embedded cluster (see the module docstring)."""

    def __init__(self, state_dir: Path, layout: Layout) -> None:
        self.state_dir = state_dir
        self.layout = layout
        self.path = state_dir / "network.json"

    # -- making and finding -----------------------------------------------------------------

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot give the cluster's nodes networks of their own (None: it can)."""
        if os.environ.get(NETWORK_ENV, "").lower() in ("loopback", "off", "0", "no", "false"):
            return f"{NETWORK_ENV}=loopback"
        if not sys.platform.startswith("linux"):
            return "network namespaces are Linux's"
        if shutil.which("ip") is None:
            return "iproute2's `ip` is not installed"
        if os.geteuid() != 0:
            return "making network namespaces needs root (CAP_NET_ADMIN)"
        return None

    @classmethod
    def open(cls, state_dir: Path) -> ClusterNetwork | str:
        """The cluster's network, made now if it is not there yet (the switch namespace and the
        controller's link), or why there can be none: then the nodes share the loopback."""
        why = cls.unavailable()
        if why is not None:
            return why
        path = state_dir / "network.json"
        layout = Layout.read(path)
        if layout is None:
            layout = new_layout(state_dir)
        network = cls(state_dir, layout)
        try:
            with network._locked():
                network._make_switch()
                network._save()
        except (OSError, subprocess.SubprocessError) as error:
            return f"could not make the cluster's network namespaces: {error}"
        return network

    @classmethod
    def existing(cls, state_dir: Path) -> ClusterNetwork | None:
        """The cluster's network as its layout file says, without making anything."""
        layout = Layout.read(state_dir / "network.json")
        return cls(state_dir, layout) if layout is not None else None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One process at a time changes the cluster's namespaces (a controller, an agent that
        steps out, a fault's helper)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "network.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(self.layout.to_json())
        tmp.replace(self.path)

    def _make_switch(self) -> None:
        if _namespace_exists(self.layout.switch):
            return
        with _machine_lock():
            ours = any(_namespace_exists(self.layout.namespace(n)) for n in self.layout.nodes)
            if not ours and self.layout.mgmt in _used_prefixes():  # another cluster's since
                self.layout = new_layout(self.state_dir, self.layout.nodes)
            self._make_links()
        self._save()

    def _make_links(self) -> None:
        layout = self.layout
        link, address = layout.controller_link, layout.controller_address
        _ip(None, [f"netns add {layout.switch}"])
        _ip(None, [f"link add {link} type veth peer name c0 netns {layout.switch}"])
        _ip(
            layout.switch,
            [
                "link set lo up",
                "link add mgmt type bridge",
                "link add data type bridge",
                "link set mgmt up",
                "link set data up",
                "link set c0 master mgmt",
                "link set c0 up",
            ],
        )
        _ip(None, [f"addr add {address}/16 dev {link}", f"link set {link} up"])

    def ensure_node(self, node: str) -> None:
        """Give `node` its namespace and its two links, unless it has them."""
        with self._locked():
            self._make_switch()
            layout = self.layout
            if node not in layout.nodes:
                layout.nodes[node] = max(layout.nodes.values(), default=-1) + 1
                self._save()
            namespace, index = layout.namespace(node), layout.nodes[node]
            if _namespace_exists(namespace):
                return
            # a namespace of an earlier run may live on unnamed (a process still in it): its
            # switch ports go, so that its links die and the new ones can take their names
            _ip(layout.switch, [f"link del m{index}", f"link del d{index}"], check=False)
            _ip(None, [f"netns add {namespace}"])
            _ip(
                layout.switch,
                [
                    f"link add m{index} type veth peer name {MGMT_IF} netns {namespace}",
                    f"link add d{index} type veth peer name {DATA_IF} netns {namespace}",
                    f"link set m{index} master mgmt",
                    f"link set d{index} master data",
                    f"link set m{index} up",
                    f"link set d{index} up",
                ],
            )
            _ip(
                namespace,
                [
                    "link set lo up",
                    f"addr add {layout.mgmt_address(node)}/16 dev {MGMT_IF}",
                    f"addr add {layout.data_address(node)}/16 dev {DATA_IF}",
                    f"link set {MGMT_IF} up",
                    f"link set {DATA_IF} up",
                ],
            )

    def open_namespace(self, node: str) -> int:
        """A descriptor of `node`'s namespace, for `enter_namespace` in a child (close it after)."""
        path = NETNS_DIR / self.layout.namespace(node)
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise NamespaceGone(
                f"node {node}'s network namespace {path} is gone: its agent ended (the node is "
                "lost) or the cluster's network was removed"
            ) from None

    def in_namespace(self, node: str, work: Callable[[], _T]) -> _T:
        """Run `work` on a thread of its own inside `node`'s namespace (namespaces are per
        thread; the caller's stays where it is)."""
        result: list[_T] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                fd = self.open_namespace(node)
                try:
                    enter_namespace(fd)
                finally:
                    os.close(fd)
                result.append(work())
            except BaseException as error:  # handed to the caller
                failure.append(error)

        thread = threading.Thread(target=run, name="relaunch-netns")
        thread.start()
        thread.join()
        if failure:
            raise failure[0]
        return result[0]

    def free_port(self, node: str) -> int:
        """A TCP port nobody listens on in `node`'s namespace now."""

        def pick() -> int:
            with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
                s.bind(("0.0.0.0", 0))
                port: int = s.getsockname()[1]
                return port

        return self.in_namespace(node, pick)

    # -- removing ---------------------------------------------------------------------------

    def remove(self) -> None:
        """Delete every namespace of the cluster: its links go with them (a node's namespace
        lives on while a process still runs in it, and goes when the last one exits), and the
        root namespace's routes a partition left (a blackhole route belongs to no link)."""
        with self._locked():
            names = [self.layout.namespace(n) for n in self.layout.nodes]
            names.append(self.layout.switch)
            _delete(names)
            self._forget_partitions()

    def _forget_partitions(self) -> None:
        layout = self.layout
        routes = [f"route del blackhole {layout.mgmt_address(n)}/32" for n in layout.nodes]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _ip(None, routes, check=False)

    def step_out(self, node: str) -> None:
        """`node`'s agent, about to exit: its namespace is deleted, and the switch's with the
        last node's, so that an abandoned cluster leaves no namespace or link behind."""
        with self._locked():
            layout = self.layout
            _delete([layout.namespace(node)])
            left = [n for n in layout.nodes if _namespace_exists(layout.namespace(n))]
            if not left:
                _delete([layout.switch])
                self._forget_partitions()

    # -- faults -----------------------------------------------------------------------------

    def fault_commands(
        self, node: str, kind: LinkFaultKind, cut: Cut | None, rate_mbit: float | None, undo: bool
    ) -> list[tuple[str | None, str, list[str]]]:
        """What applies (or, `undo`, removes) a fault: (namespace, tool, commands) in order."""
        layout = self.layout
        index, namespace = layout.nodes[node], layout.namespace(node)
        if kind is LinkFaultKind.DOWN:
            return [(layout.switch, "ip", [f"link set d{index} {'up' if undo else 'down'}"])]
        if kind is LinkFaultKind.DEGRADED:
            if undo:
                return [
                    (namespace, "tc", [f"qdisc del dev {DATA_IF} root"]),
                    (layout.switch, "tc", [f"qdisc del dev d{index} root"]),
                ]
            shape = f"tbf rate {rate_mbit or 1:g}mbit burst 32kbit latency 400ms"
            return [
                (namespace, "tc", [f"qdisc replace dev {DATA_IF} root {shape}"]),
                (layout.switch, "tc", [f"qdisc replace dev d{index} root {shape}"]),
            ]
        verb = "del" if undo else "add"
        steps: list[tuple[str | None, str, list[str]]] = []
        if cut in (Cut.CONTROLLER, Cut.BOTH):
            steps.append(
                (namespace, "ip", [f"route {verb} blackhole {layout.controller_address}/32"])
            )
            steps.append((None, "ip", [f"route {verb} blackhole {layout.mgmt_address(node)}/32"]))
        if cut in (Cut.PEERS, Cut.BOTH):
            peers = [n for n in layout.nodes if n != node]
            steps.append(
                (
                    namespace,
                    "ip",
                    [f"route {verb} blackhole {layout.data_address(p)}/32" for p in peers],
                )
            )
            for peer in peers:
                if _namespace_exists(layout.namespace(peer)):
                    steps.append(
                        (layout.namespace(peer), "ip",
                         [f"route {verb} blackhole {layout.data_address(node)}/32"])
                    )  # fmt: skip
        return steps

    def apply(
        self,
        node: str,
        kind: LinkFaultKind,
        cut: Cut | None = None,
        rate_mbit: float | None = None,
        undo: bool = False,
    ) -> bool:
        """Apply (or undo) a fault; False if the cluster's network is gone (removed before a
        late fault came): then nothing is done, not even in the root namespace, whose
        blackhole routes nobody would remove again."""
        with self._locked():
            if not undo and not _namespace_exists(self.layout.switch):
                return False
            for namespace, tool, commands in self.fault_commands(node, kind, cut, rate_mbit, undo):
                if namespace is not None and not _namespace_exists(namespace):
                    continue  # a node that went meanwhile has no link to cut or mend
                try:
                    _ip(namespace, commands, tool)
                except OSError:
                    if not undo:
                        raise  # undoing: what is already gone stays gone (-force goes on)
        return True


def _delete(names: list[str]) -> None:
    present = [n for n in names if _namespace_exists(n)]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        _ip(None, [f"netns del {n}" for n in present])
