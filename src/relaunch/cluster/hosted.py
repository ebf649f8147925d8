"""Pods started by their node's agent, for engines whose nodes are machines of their own.

On the embedded cluster and on Ray an engine process on the node forks each pod's launcher. On a
Slurm allocation (and on machines where an operator starts `relaunch agent` by hand) the only
relaunch process on a node is its agent, connected to the controller: `HostedPods` keeps each
agent's connection from its hello, sends it the plan of every pod to start there (`StartPod`; a
plan for a node whose agent has not said hello yet waits for it), and knows the node's address
and a free port from what the agent last said (MASTER_ADDR, MASTER_PORT). A node-down is a
`Crash` to the agent (see cluster.podhost).
"""

from __future__ import annotations

import threading
from typing import Protocol

from relaunch.cluster.local import free_port
from relaunch.protocol.messages import AgentHello, Crash, Heartbeat, Message, StartPod
from relaunch.protocol.plans import LaunchPlan

__all__ = ["HostedPods"]


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
