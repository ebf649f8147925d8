"""Pods started by their node's agent, for engines whose nodes are machines of their own.

On the embedded cluster and on Ray an engine process on the node forks each pod's launcher. On a
Slurm allocation (and on machines where an operator starts `relaunch agent` by hand) the only
relaunch process on a node is its agent, connected to the controller: `HostedPods` keeps each
agent's connection from its hello, sends it the plan of every pod to start there (`StartPod`; a
plan for a node whose agent has not said hello yet waits for it), and knows the node's address
and a free port from what the agent last said (MASTER_ADDR, MASTER_PORT). A node-down is a
`Crash` to the agent (see cluster.podhost).

`AgentsCluster` is the engine of a fixed set of machines without a scheduler: an operator starts
`relaunch agent --controller HOST:PORT --node NAME` on each machine of the cluster file, and the
controller listens on that HOST:PORT (`relaunch run --engine agents --address HOST:PORT`). The
Slurm engine is the same engine whose agents `srun` starts (cluster.slurm).
"""

from __future__ import annotations

import threading
from typing import Protocol

from relaunch.cluster import EngineBase, EngineFacts, NoRehearsal, Rehearsal
from relaunch.cluster.config import NodeSpec
from relaunch.cluster.local import free_port
from relaunch.protocol.messages import AgentHello, Crash, Heartbeat, Message, StartPod
from relaunch.protocol.plans import LaunchPlan

__all__ = ["AgentsCluster", "HostedPods"]


class AgentPeer(Protocol):
    closed: bool

    def send(self, message: Message, *, urgent: bool | None = None) -> bool: ...


class HostedPods:
    """The engine's side of agents that start their node's pods (see the module docstring)."""

    def __init__(self) -> None:
        self.peers: dict[str, AgentPeer] = {}
        self.addresses: dict[str, str] = {}
        self.ports: dict[str, int] = {}
        self.waiting: dict[str, list[LaunchPlan]] = {}
        """Plans for nodes whose agent has not said hello (yet, or again)."""
        self.lock = threading.Lock()

    def heard(self, node: str, peer: AgentPeer, message: AgentHello | Heartbeat) -> None:
        """An agent's hello or heartbeat, as the controller read it."""
        if isinstance(message, AgentHello):
            if not message.hosts_pods:
                return
            with self.lock:
                self.peers[node] = peer
                if message.address:
                    self.addresses[node] = message.address
                waiting = self.waiting.pop(node, [])
            for plan in waiting:
                peer.send(StartPod(plan))
        elif self.peers.get(node) is not peer:
            return
        if message.free_port:
            self.ports[node] = message.free_port

    def start_pod(self, plan: LaunchPlan) -> int:
        with self.lock:
            peer = self.peers.get(plan.node)
            if peer is None or peer.closed or not peer.send(StartPod(plan)):
                self.waiting.setdefault(plan.node, []).append(plan)
        return -1  # the agent's to know

    def crash(self, node: str) -> bool:
        """The fault plan's node-down, sent to the node's agent; False if it is gone already."""
        peer = self.peers.pop(node, None)
        return peer is not None and peer.send(Crash())

    def forget(self, node: str) -> None:
        """The node is lost: what waited for its agent starts nowhere."""
        with self.lock:
            self.waiting.pop(node, None)
            self.peers.pop(node, None)

    def address(self, node: str, default: str) -> str:
        return self.addresses.get(node, default)

    def free_port(self, node: str) -> int:
        """The port the node's agent last said was free (a port free here where it said none)."""
        return self.ports.get(node) or free_port()


class AgentsCluster(EngineBase):
    """The engine of machines whose agents an operator started (see the module docstring)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        """The controller's port, fixed: the agents were given it."""
        self.hosted = HostedPods()

    @property
    def bind_host(self) -> str:
        return self.host

    @property
    def listen_port(self) -> int:
        return self.port

    @property
    def facts(self) -> EngineFacts:
        return EngineFacts(
            chips="chips are what each node's agent reads (its GPUs through NVML, or simulated)",
            containers="pods are cgroups on their node where its agent can make them (see its log)",
            networks="nodes use their own networks; a network fault is simulated (the agent "
            "reports it)",
        )

    @property
    def rehearsal(self) -> Rehearsal:
        return _AgentsRehearsal(self.hosted, "relaunch does not own these machines' links")

    def start_agent(self, node: NodeSpec, interval: float, grace: float, blip_s: float) -> int:
        """The operator starts each machine's agent: nothing to start here."""
        return -1

    def agent_heard(self, node: str, peer: AgentPeer, message: AgentHello | Heartbeat) -> None:
        self.hosted.heard(node, peer, message)

    def start_pod(self, plan: LaunchPlan) -> int:
        return self.hosted.start_pod(plan)

    def node_address(self, node: str) -> str:
        return self.hosted.address(node, node)

    def free_port(self, node: str) -> int:
        return self.hosted.free_port(node)


class _AgentsRehearsal(NoRehearsal):
    """The fault plan's node-down where agents host the pods: the node's agent kills its pods
    and exits; links are not relaunch's to cut."""

    def __init__(self, hosted: HostedPods, why: str) -> None:
        super().__init__(why)
        self.hosted = hosted

    def kill_node(self, node: str) -> None:
        self.hosted.crash(node)
