"""Local trial clusters (a head and one `ray start` per node), the command that keeps one up, and
the loopback-only network namespace tests and benchmarks run them in.

A trial cluster runs every node on 127.0.0.1, or, given the embedded cluster's network
(`cluster.network`), each node's `ray start` in the node's own namespace with its management
address, the head on the controller's address: then the nodes' ranks talk over their data links
(`GLOO_SOCKET_IFNAME=data0` in the nodes' environment), and a link can be cut."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import ray

from relaunch.cluster.config import NodeSpec
from relaunch.cluster.local import free_port, kill_tree
from relaunch.cluster.network import DATA_IF, NETNS_DIR, ClusterNetwork
from relaunch.cluster.ray.discovery import (
    CHIPS_RESOURCE,
    HEALTH_CHECK,
    NODE_RESOURCE,
    connect,
    discover,
)
from relaunch.errors import EngineError

__all__ = ["LoopbackNamespace", "TrialCluster", "serve"]

# -- local trial clusters ---------------------------------------------------------------------------


class TrialCluster:
    """A local multi-node Ray cluster: a head (no relaunch resources) and one `ray start` per
    node, each named by ``relaunch_node:<name>`` with ``relaunch_chips``, on 127.0.0.1 or, with
    `network`, each in its node's namespace (see the module docstring).

    Each node is a `ray start --block` process in a session of its own; removing a node kills
    that process and everything under it (raylet, workers, and relaunch's processes there)."""

    def __init__(
        self,
        nodes: tuple[NodeSpec, ...],
        *,
        memory_mb: int = 512,
        object_store_mb: int = 80,
        log: Path | None = None,
        health_check: dict[str, str] | None = None,
        network: ClusterNetwork | None = None,
    ) -> None:
        self.nodes = nodes
        self.memory = memory_mb * 1024 * 1024
        self.object_store = object_store_mb * 1024 * 1024
        self.temp_dir = Path(f"/tmp/relaunch-ray-{os.getpid()}-{int(time.time() * 1000) % 100000}")
        self.log = log or Path(f"{self.temp_dir}.log")
        self.network = network
        self.head_ip = network.layout.controller_address if network else "127.0.0.1"
        self.port = free_port()
        self.address = f"{self.head_ip}:{self.port}"
        self.health_check = HEALTH_CHECK if health_check is None else health_check
        """GCS settings (environment variables); {} keeps Ray's defaults (benchmarks)."""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._dead_since: dict[str, float] = {}

    def _ray_start(self, name: str, args: list[str]) -> None:
        ray_bin = Path(sys.executable).with_name("ray")
        address, enter, interface = self.head_ip, [], "lo"
        if self.network is not None and name != "head":
            self.network.ensure_node(name)
            address = self.network.layout.mgmt_address(name)
            enter = ["nsenter", f"--net={NETNS_DIR / self.network.layout.namespace(name)}"]
            interface = DATA_IF
        command = [*enter, str(ray_bin), "start", "--block", "--node-ip-address", address,
                   "--memory", str(self.memory), "--object-store-memory", str(self.object_store),
                   "--disable-usage-stats", "--temp-dir", str(self.temp_dir),
                   "--include-log-monitor", "false", *args]  # fmt: skip
        # The node environment tells gloo which interface its ranks talk over: on 127.0.0.1 the
        # loopback (it would look for the host name's address, absent in a loopback-only
        # namespace), in a node's namespace its data link.
        env = {
            **os.environ,
            **self.health_check,
            "RAY_USAGE_STATS_ENABLED": "0",
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", interface),
        }
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.procs[name] = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def start_node(self, node: NodeSpec) -> None:
        resources = {f"{NODE_RESOURCE}{node.name}": 1, CHIPS_RESOURCE: node.chips}
        self._ray_start(
            node.name,
            ["--address", self.address, "--num-cpus", "1", "--resources", json.dumps(resources)],
        )

    def start(self, timeout: float = 90.0, progress: Any = None) -> str:
        """Start the head and every node; the address once Ray sees them all alive."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self._ray_start("head", ["--head", "--port", str(self.port), "--num-cpus", "0",
                                 "--include-dashboard", "false"])  # fmt: skip
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.procs["head"].poll() is not None:
                raise EngineError(f"the Ray head did not start; see {self.log}")
            try:
                socket.create_connection((self.head_ip, self.port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        connect(self.address)
        for done, node in enumerate(self.nodes):
            # one at a time: raylets starting together on a small machine time out registering
            self.start_node(node)
            self.wait_for(node.name, deadline)
            if progress is not None:
                progress(done + 1, len(self.nodes))
        return self.address

    def wait_for(self, name: str, deadline: float, stop: bool = True) -> None:
        """Until Ray lists the node `name` alive (EngineError if not; the cluster stopped
        first, unless `stop` is False)."""
        why = "did not join in time"
        while time.time() < deadline:
            if any(n.name == name for n in discover()):
                return
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                why = "exited at start"
                break
            time.sleep(0.2)
        if stop:
            self.stop()
        raise EngineError(f"Ray node {name} {why}; see {self.log}")

    def remove_node(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            kill_tree(proc.pid)
            proc.wait()

    def stop(self) -> None:
        """Remove every node, the head last, and the cluster's temporary directory."""
        with contextlib.suppress(Exception):
            ray.shutdown()
        family: list[psutil.Process] = []  # every node's processes, killed at once
        for proc in self.procs.values():
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(proc.pid)
                family += [root, *root.children(recursive=True)]
        for process in family:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(family, timeout=10)
        for proc in self.procs.values():
            proc.wait()
        self.procs.clear()
        for leftover in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if any(str(self.temp_dir) in part for part in leftover.info["cmdline"] or []):
                    kill_tree(leftover.info["pid"])
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def heal(self, grace_s: float = 2.0) -> list[str]:
        """Start again, one at a time, every node whose `ray start` exited or that Ray has
        declared dead for `grace_s`; the names started."""
        alive = {n.name for n in discover()}
        now = time.time()
        healed = []
        for node in self.nodes:
            proc = self.procs.get(node.name)
            if node.name in alive and proc is not None and proc.poll() is None:
                self._dead_since.pop(node.name, None)
                continue
            since = self._dead_since.setdefault(node.name, now)
            if proc is not None and proc.poll() is None and now - since < grace_s:
                continue  # Ray may list it a moment late
            self._restart_node(node)
            self._dead_since.pop(node.name, None)
            healed.append(node.name)
        return healed

    def _restart_node(self, node: NodeSpec, tries: int = 3) -> None:
        """Start the node again; a start that Ray itself gives up on (its raylet timed out
        registering, on a machine busy with other work) is tried again, the cluster kept."""
        for attempt in range(1, tries + 1):
            self.remove_node(node.name)
            self.start_node(node)
            try:
                self.wait_for(node.name, time.time() + 60, stop=attempt == tries)
                return
            except EngineError:
                if attempt == tries:
                    raise


def serve(argv: list[str] | None = None) -> None:
    """`python -m relaunch.cluster.ray --cluster FILE --status FILE [--heal] [--network DIR]`:
    keep a local trial cluster up (for tests, or for several runs with --address) until SIGTERM,
    then remove it. The status file says its address and which nodes are alive; with --heal, a
    removed node is started again so that the next run finds the whole cluster; with --network,
    each node runs in a network namespace of its own, the network's state kept in DIR (root)."""
    import argparse

    from relaunch.cluster.config import parse_cluster
    from relaunch.files import read_document

    parser = argparse.ArgumentParser(prog="python -m relaunch.cluster.ray")
    parser.add_argument("--cluster", type=Path, required=True)
    parser.add_argument("--status", type=Path, required=True)
    parser.add_argument("--heal", action="store_true")
    parser.add_argument("--network", type=Path, help="give each node a network namespace")
    args = parser.parse_args(argv)
    shape = parse_cluster(read_document(args.cluster), source=str(args.cluster))
    network = ClusterNetwork.open(args.network) if args.network else None
    if isinstance(network, str):
        parser.exit(2, f"the trial cluster's nodes cannot have networks of their own: {network}\n")
    trial = TrialCluster(shape.nodes, log=args.status.with_suffix(".log"), network=network)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())

    def status(alive: list[str]) -> None:
        tmp = args.status.with_suffix(".tmp")
        pids = {name: proc.pid for name, proc in trial.procs.items()}
        tmp.write_text(
            json.dumps({"address": trial.address, "alive": alive, "pids": pids, "at": time.time()})
        )
        tmp.replace(args.status)

    try:
        trial.start()
        while not stopping.wait(0.3):
            if args.heal:
                trial.heal()
            status(sorted(n.name for n in discover()))
    finally:
        trial.stop()
        if network is not None:
            network.remove()
        args.status.unlink(missing_ok=True)


class LoopbackNamespace:
    """A network namespace with only a loopback interface (root and iproute2 needed), in which a
    local Ray cluster keeps 127.0.0.1 (on the host network Ray rewrites it to the host's address).
    Its own /etc/hosts (mounted by `ip netns exec`) resolves the host name and the loopback
    addresses without DNS, which the namespace cannot reach. Used by the tests and benchmarks."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.etc = Path("/etc/netns") / name

    def create(self) -> LoopbackNamespace:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise EngineError("a network namespace needs root and iproute2 (`ip`)")
        self.etc.mkdir(parents=True, exist_ok=True)
        names = f"localhost {socket.gethostname()}"
        (self.etc / "hosts").write_text(
            f"127.0.0.1 {names}\n::1 {names}\n::ffff:127.0.0.1 {names}\n"
        )
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        subprocess.run(
            ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"], check=True
        )
        return self

    def command(self, args: list[str]) -> list[str]:
        """`args` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *args]

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)
        shutil.rmtree(self.etc, ignore_errors=True)
