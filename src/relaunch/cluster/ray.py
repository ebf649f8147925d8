"""Ray as the engine: the same agents and launchers as the embedded cluster, on Ray nodes.

Every node relaunch uses gets one *node host*: a detached Ray actor pinned to that node
(NodeAffinitySchedulingStrategy, not soft) that starts the node's agent and its pods' launchers as
ordinary processes, in the node's own environment, exactly as the embedded cluster starts them on
one machine. The controller stays where `relaunch run` runs and listens on an address every node
reaches; agents and launchers connect to it as they do on the embedded cluster, so every recovery
works the same way.

A node is lost when Ray marks it dead or when its agent falls silent, whichever comes first.
What bounds Ray's part is the GCS health check; :data:`HEALTH_CHECK` holds the settings relaunch
gives the clusters it starts (see docs/ray.md for the measurements).

Nodes are named by a custom resource ``relaunch_node:<name>`` (what `relaunch run --engine ray`
gives the nodes of a trial cluster; add it to `ray start --resources` on a real one), otherwise
``ray-<first 8 hex digits of the node id>``. A node's chips are its ``relaunch_chips`` resource,
otherwise its GPUs.

Requires the `ray` extra: ``pip install relaunch[ray]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from relaunch.cluster.config import NodeSpec
from relaunch.cluster.local import free_port, kill_tree
from relaunch.protocol import LaunchPlan, PodDir

__all__ = [
    "CHIPS_RESOURCE",
    "HEALTH_CHECK",
    "NODE_RESOURCE",
    "RayCluster",
    "RayNode",
    "connect",
    "discover",
]

NODE_RESOURCE = "relaunch_node:"
"""Prefix of the custom resource that names a node: ``relaunch_node:node-0``."""
CHIPS_RESOURCE = "relaunch_chips"
NAMESPACE = "relaunch"
HEALTH_CHECK = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "2",
    "RAY_health_check_initial_delay_ms": "1000",
}
"""GCS settings for the clusters relaunch starts: a crashed or hung raylet is declared dead in
1-2 s instead of 15-30 s and more with Ray's defaults (benchmarks/ray_detection.py); a node is
checked from 1 s after it joins, not 5 s."""
CALL_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class RayNode:
    name: str
    node_id: str
    address: str
    chips: int
    alive: bool
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


def _name(node_id: str, resources: dict[str, float]) -> str:
    for key in resources:
        if key.startswith(NODE_RESOURCE):
            return key[len(NODE_RESOURCE) :]
    return f"ray-{node_id[:8]}"


def _selected(node: RayNode, select: str | None) -> bool:
    if select is None:
        return True
    key, _, value = select.partition("=")
    if value:
        return node.labels.get(key) == value
    return key in node.labels or node.resources.get(key, 0) > 0


def discover(select: str | None = None, *, include_dead: bool = False) -> list[RayNode]:
    """The Ray nodes relaunch may use, by name: those carrying `select` (a resource, a label, or
    label=value); by default the nodes named by a ``relaunch_node:`` resource if there are any,
    else every node. A name held by a dead node and a live one is the live one's."""
    found: dict[str, RayNode] = {}
    for raw in ray.nodes():
        resources = {str(k): float(v) for k, v in (raw.get("Resources") or {}).items()}
        node = RayNode(
            name=_name(raw["NodeID"], resources),
            node_id=raw["NodeID"],
            address=raw.get("NodeManagerAddress") or "127.0.0.1",
            chips=int(resources.get(CHIPS_RESOURCE, resources.get("GPU", 0))),
            alive=bool(raw.get("Alive")),
            resources=resources,
            labels={str(k): str(v) for k, v in (raw.get("Labels") or {}).items()},
        )
        if not (node.alive or include_dead) or not _selected(node, select):
            continue
        known = found.get(node.name)
        if known is None or (node.alive and not known.alive):
            found[node.name] = node
    if select is None and any(n.name != f"ray-{n.node_id[:8]}" for n in found.values()):
        found = {k: n for k, n in found.items() if n.name != f"ray-{n.node_id[:8]}"}
    return sorted(found.values(), key=lambda n: n.name)


def connect(address: str) -> None:
    """Join the Ray cluster at `address` as a driver (once per process)."""
    if ray.is_initialized():
        return
    # Ray's core takes over SIGTERM (it dumps a stack and kills the process); relaunch keeps its
    # own, so that a terminated run or trial cluster still cleans up after itself.
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            logging_level=logging.ERROR,
            log_to_driver=False,
            include_dashboard=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise RuntimeError(
            f"cannot reach the Ray cluster at {address}: {error}. Check the address "
            "(`ray status --address ...`), or leave --address out to start a local trial cluster"
        ) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _node_environment() -> dict[str, str]:
    """The node's own environment: the raylet's (as its operator started it), not the one Ray
    gives its workers (Ray sets CUDA_VISIBLE_DEVICES and its own variables there)."""
    try:
        env = dict(psutil.Process(os.getppid()).environ())
    except psutil.Error:
        env = dict(os.environ)
    return {k: v for k, v in env.items() if not k.startswith("RAY_")}


class NodeHost:
    """Runs on one node (a detached actor); starts and kills relaunch's processes there."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.children: dict[str, int] = {}
        self.raylet = os.getppid()
        self.dead = False

    def ping(self) -> int:
        return os.getpid()

    def spawn(self, key: str, module: str, args: list[str], log: str, files: dict[str, str]) -> int:
        if self.dead:
            raise RuntimeError("this node is going down")
        for path, text in files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, "--state-dir", self.state_dir, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives this actor and the controller, as on local
                env=_node_environment(),
            )
        self.children[key] = proc.pid
        threading.Thread(target=proc.wait, daemon=True).start()  # reap it
        return proc.pid

    def rekey(self, old: str, new: str) -> None:
        if old in self.children:
            self.children[new] = self.children.pop(old)

    def kill_all(self) -> None:
        for pid in self.children.values():
            kill_tree(pid)
        self.children.clear()

    def free_port(self) -> int:
        return free_port("0.0.0.0")

    def crash(self) -> None:
        """The node dies at once: every process relaunch started here, its raylet, this actor.
        Nothing is started here any more, and nothing waits: a node does not die in steps."""
        self.dead = True
        family: list[psutil.Process] = []
        for pid in self.children.values():
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                family += [root, *root.children(recursive=True)]
        for process in family:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(self.raylet, signal.SIGKILL)
        os._exit(1)


_Host: Any = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(NodeHost)  # type: ignore[call-overload]


class RayCluster:
    """The engine on a Ray cluster: one node host per node, node loss from Ray's node table."""

    def __init__(
        self,
        state_dir: Path,
        address: str,
        nodes: list[RayNode],
        *,
        expected: list[str] | None = None,
        remove_node: Callable[[str], None] | None = None,
        poll_s: float = 0.1,
    ) -> None:
        connect(address)
        self.state_dir = state_dir
        self.address = address
        self.nodes = {n.name: n for n in nodes}
        missing = {name for name in expected or [] if name not in self.nodes}
        """Nodes the job knows that Ray does not (any more): lost from the start."""
        self.remove_node = remove_node
        """How node-down removes a node: a trial cluster removes its `ray start` process; on any
        other cluster the node host kills relaunch's processes and the node's raylet."""
        digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:10]
        self.prefix = f"relaunch-{digest}"
        self.bind_host = ray.util.get_node_ip_address()
        self.hosts: dict[str, Any] = {}
        self._crashing: list[tuple[Any, Any]] = []
        self._lost: set[str] = missing | {n.name for n in nodes if not n.alive}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.poll_s = poll_s
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    @classmethod
    def open(
        cls,
        state_dir: Path,
        address: str,
        expected: list[str],
        *,
        select: str | None = None,
        remove_node: Callable[[str], None] | None = None,
    ) -> RayCluster:
        """Connect to the cluster at `address` and find the job's nodes in it by name."""
        connect(address)
        found = [n for n in discover(select, include_dead=True) if n.name in expected]
        engine = cls(state_dir, address, found, expected=expected, remove_node=remove_node)
        engine.start_hosts()
        return engine

    def start_hosts(self) -> None:
        """Create (or find) every live node's host at once: each is a Ray worker process, and
        starting them one by one as agents start would add their start-up times."""
        refs = [self._host(name).ping.remote() for name in self.nodes if name not in self._lost]
        ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)

    # -- node loss ----------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Ray's verdict on each node, every poll_s (a GCS call): dead ones go to `lost_nodes`."""
        while not self._stop.wait(self.poll_s):
            try:
                alive = {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}
            except Exception:  # the GCS is restarting or gone: no verdict this time
                continue
            with self._lock:
                for name, node in self.nodes.items():
                    if not alive.get(node.node_id, False):
                        self._lost.add(name)

    def lost_nodes(self) -> set[str]:
        with self._lock:
            return set(self._lost)

    # -- node hosts ---------------------------------------------------------------------------------

    def _host(self, node: str) -> Any:
        host = self.hosts.get(node)
        if host is None:
            target = self.nodes[node]
            host = _Host.options(
                name=f"{self.prefix}:{node}",
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(target.node_id, soft=False),
            ).remote(str(self.state_dir))
            self.hosts[node] = host
        return host

    def _call(self, node: str, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._host(node), method).remote(*args), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            self.hosts.pop(node, None)  # dead with its node, or unreachable: found again later
            if self._node_dead(node):
                with self._lock:
                    self._lost.add(node)
            return None

    def _node_dead(self, node: str) -> bool:
        target = self.nodes[node]
        return not any(n["NodeID"] == target.node_id and n.get("Alive") for n in ray.nodes())

    # -- the engine interface --------------------------------------------------------------------

    def start_agent(self, node: NodeSpec, interval: float, grace: float, blip_s: float) -> int:
        args = ["--node", node.name, "--chips", str(node.chips), "--interval", str(interval),
                "--grace", str(grace), "--blip", str(blip_s)]  # fmt: skip
        log = str(self.state_dir / "logs" / f"agent-{node.name}.log")
        pid = self._call(node.name, "spawn", "agent", "relaunch.cluster.agent", args, log, {})
        return int(pid or -1)

    def start_pod(self, plan: LaunchPlan) -> int:
        plan_file = str(PodDir(Path(plan.workdir)).plan)
        key = f"{plan.job}/{plan.pod}/{plan.generation}"
        pid = self._call(
            plan.node,
            "spawn",
            key,
            "relaunch.launcher",
            ["--plan", plan_file],
            str(Path(plan.workdir) / "launcher.log"),
            {plan_file: plan.to_json()},
        )
        return int(pid or -1)

    def assumed(self, job: int, node: str, pod: int, generation: int) -> None:
        self._call(node, "rekey", f"{job}/-1/0", f"{job}/{pod}/{generation}")

    def kill_node(self, node: str) -> None:
        if self.remove_node is not None:
            # in the background: the controller keeps watching while the node goes down
            threading.Thread(target=self.remove_node, args=(node,), daemon=True).start()
            return
        host = self._host(node)
        # no answer comes (the actor dies with its raylet); the handle and the reference are kept
        # so that the call is surely sent
        self._crashing.append((host, host.crash.remote()))
        self.hosts.pop(node, None)

    def shutdown(self) -> None:
        self._stop.set()
        hosts = []
        for node in list(self.nodes):
            if node in self.lost_nodes():
                continue
            with contextlib.suppress(ValueError):
                hosts.append(ray.get_actor(f"{self.prefix}:{node}", namespace=NAMESPACE))
        done: list[Any] = [host.kill_all.remote() for host in hosts]  # every node at once
        ray.wait(done, num_returns=len(done), timeout=CALL_TIMEOUT_S)
        for host in hosts:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(host)
        self.hosts.clear()

    def node_address(self, node: str) -> str:
        known = self.nodes.get(node)
        return known.address if known is not None else self.bind_host

    def free_port(self, node: str) -> int:
        return int(self._call(node, "free_port") or free_port())


# -- local trial clusters ---------------------------------------------------------------------------


class TrialCluster:
    """A local multi-node Ray cluster: a head (no relaunch resources) and one `ray start` per
    node, each named by ``relaunch_node:<name>`` with ``relaunch_chips``, on 127.0.0.1.

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
    ) -> None:
        self.nodes = nodes
        self.memory = memory_mb * 1024 * 1024
        self.object_store = object_store_mb * 1024 * 1024
        self.temp_dir = Path(f"/tmp/relaunch-ray-{os.getpid()}-{int(time.time() * 1000) % 100000}")
        self.log = log or Path(f"{self.temp_dir}.log")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.health_check = HEALTH_CHECK if health_check is None else health_check
        """GCS settings (environment variables); {} keeps Ray's defaults (benchmarks)."""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._dead_since: dict[str, float] = {}

    def _ray_start(self, name: str, args: list[str]) -> None:
        ray_bin = Path(sys.executable).with_name("ray")
        command = [str(ray_bin), "start", "--block", "--node-ip-address", "127.0.0.1",
                   "--memory", str(self.memory), "--object-store-memory", str(self.object_store),
                   "--disable-usage-stats", "--temp-dir", str(self.temp_dir),
                   "--include-log-monitor", "false", *args]  # fmt: skip
        # Every node of a trial cluster is on 127.0.0.1: the node environment tells gloo so
        # (it would look for the host name's address, absent in a loopback-only namespace).
        env = {
            **os.environ,
            **self.health_check,
            "RAY_USAGE_STATS_ENABLED": "0",
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
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
                raise RuntimeError(f"the Ray head did not start; see {self.log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
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

    def wait_for(self, name: str, deadline: float) -> None:
        """Until Ray lists the node `name` alive (RuntimeError, the cluster stopped, if not)."""
        while time.time() < deadline:
            if any(n.name == name for n in discover()):
                return
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"Ray node {name} exited at start; see {self.log}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"Ray node {name} did not join in time; see {self.log}")

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
            self.remove_node(node.name)
            self.start_node(node)
            self.wait_for(node.name, time.time() + 60)
            self._dead_since.pop(node.name, None)
            healed.append(node.name)
        return healed


def serve(argv: list[str] | None = None) -> None:
    """`python -m relaunch.cluster.ray --cluster FILE --status FILE [--heal]`: keep a local trial
    cluster up (for tests, or for several runs with --address) until SIGTERM, then remove it.
    The status file says its address and which nodes are alive; with --heal, a removed node is
    started again so that the next run finds the whole cluster."""
    import argparse

    from relaunch.cluster.config import parse_cluster
    from relaunch.files import read_document

    parser = argparse.ArgumentParser(prog="python -m relaunch.cluster.ray")
    parser.add_argument("--cluster", type=Path, required=True)
    parser.add_argument("--status", type=Path, required=True)
    parser.add_argument("--heal", action="store_true")
    args = parser.parse_args(argv)
    shape = parse_cluster(read_document(args.cluster), source=str(args.cluster))
    trial = TrialCluster(shape.nodes, log=args.status.with_suffix(".log"))
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
        args.status.unlink(missing_ok=True)


if __name__ == "__main__":
    serve()


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
            raise RuntimeError("a network namespace needs root and iproute2 (`ip`)")
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
