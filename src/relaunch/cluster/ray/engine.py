"""RayCluster: the Engine on a Ray cluster (one node host per node)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from relaunch.cluster import NOTHING_COUNTED, EngineBase, EngineFacts, LeftBehind, Rehearsal
from relaunch.cluster.config import NodeSpec
from relaunch.cluster.local import free_port
from relaunch.cluster.ray.discovery import CALL_TIMEOUT_S, NAMESPACE, RayNode, connect, discover
from relaunch.cluster.ray.host import RemoteNodeHost
from relaunch.protocol.layout import PodDir
from relaunch.protocol.links import Cut, LinkFaultKind
from relaunch.protocol.plans import LaunchPlan

__all__ = ["RayCluster"]


class RayCluster(EngineBase):
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
        self.head_address: str = ray.util.get_node_ip_address()
        self.hosts: dict[str, Any] = {}
        self._crashing: list[tuple[Any, Any]] = []
        self._lost: set[str] = missing | {n.name for n in nodes if not n.alive}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.poll_s = poll_s
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    @functools.cached_property
    def facts(self) -> EngineFacts:
        """Asked of the node hosts once (the controller reads it at each pod's start).
        A Ray cluster's nodes are hosts of their own (a test's on one machine too: its pods'
        processes set OMP_NUM_THREADS by their pod's count, as on separate hosts); Ray gives
        each worker its GPUs itself (CUDA_VISIBLE_DEVICES)."""
        return EngineFacts(
            chips="chips are the Ray nodes' own GPUs, which Ray gives each worker",
            containers=self._containers(),
            networks="nodes use the Ray nodes' own networks; a network fault is simulated (the "
            "agent reports it), partition and degraded-link faults cannot fire",
        )

    @property
    def rehearsal(self) -> Rehearsal:
        return self

    @property
    def bind_host(self) -> str:
        """The controller's Ray node's address: every node reaches it."""
        return self.head_address

    def _containers(self) -> str:
        """What a pod is on each node, in words (said once at start)."""
        said = {}
        for name in self.nodes:
            if name not in self._lost:
                said[name] = self._call(name, "containers") or "no answer"
        if said and all(what.startswith("cgroups") for what in said.values()):
            return "pods are cgroups on every node"
        return "pods: " + "; ".join(f"{node}: {what}" for node, what in sorted(said.items()))

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

    def lost_nodes(self) -> dict[str, str]:
        with self._lock:
            return dict.fromkeys(self._lost, "Ray reports the node dead")

    # -- node hosts ---------------------------------------------------------------------------------

    def _host(self, node: str) -> Any:
        host = self.hosts.get(node)
        if host is None:
            target = self.nodes[node]
            host = RemoteNodeHost.options(
                name=f"{self.prefix}:{node}",
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(target.node_id, soft=False),
            ).remote(str(self.state_dir), node)
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

    def shutdown(self) -> LeftBehind:
        """Every node host kills what its pods left (counted: the hosts count, they do not
        name; None where a node has no cgroups, or did not answer)."""
        self._stop.set()
        hosts = []
        for node in list(self.nodes):
            if node in self.lost_nodes():
                continue
            with contextlib.suppress(ValueError):
                hosts.append(ray.get_actor(f"{self.prefix}:{node}", namespace=NAMESPACE))
        done: list[Any] = [host.kill_all.remote() for host in hosts]  # every node at once
        ready, _ = ray.wait(done, num_returns=len(done), timeout=CALL_TIMEOUT_S)
        counts = []
        for ref in ready:
            with contextlib.suppress(ray.exceptions.RayError):
                counts.append(ray.get(ref))
        for host in hosts:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(host)
        self.hosts.clear()
        if counts and all(count is not None for count in counts):
            return LeftBehind(sum(counts))
        return NOTHING_COUNTED

    def node_address(self, node: str) -> str:
        known = self.nodes.get(node)
        return known.address if known is not None else self.head_address

    def free_port(self, node: str) -> int:
        return int(self._call(node, "free_port") or free_port())

    def inject_link_fault(
        self,
        node: str,
        kind: LinkFaultKind,
        duration_s: float | None,
        cut: Cut | None = None,
        rate_mbit: float | None = None,
    ) -> str | None:
        return "the Ray engine does not own its nodes' links"
