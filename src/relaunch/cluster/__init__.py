"""Cluster engines: where pods run. `local` is the embedded default; `ray` runs the same agents
and launchers on the nodes of a Ray cluster (optional: `pip install relaunch[ray]`); `slurm`
runs them inside a Slurm allocation, each node's agent a step that starts its node's pods.

The controller talks to an engine only through :class:`Engine`, the narrow port every engine
implements (:class:`EngineBase` holds its defaults); a fault plan's node and link faults go
through the engine's :class:`Rehearsal`. Engines are found by name in `cluster.registry`.
Nothing here imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping

    from relaunch.cluster.config import NodeSpec
    from relaunch.protocol.links import Cut, LinkFaultKind
    from relaunch.protocol.messages import AgentHello, Heartbeat
    from relaunch.protocol.plans import LaunchPlan

__all__ = [
    "NOTHING_COUNTED",
    "Engine",
    "EngineBase",
    "EngineFacts",
    "LeftBehind",
    "NoRehearsal",
    "Rehearsal",
    "Settled",
]


@dataclass(frozen=True)
class EngineFacts:
    """What an engine is, as data: the few choices the controller makes by it, and the words
    `relaunch run` says once at start."""

    chips: str
    """What a node's chips are on this engine (GPUs, or simulated and why)."""
    containers: str
    """What a pod is on this engine (cgroups or process groups, and why)."""
    networks: str
    """What a node's network is on this engine (and which link faults are real)."""
    chips_are_gpus: bool = False
    """A node's chips are the machine's NVIDIA GPUs (node by node: ClusterConfig's first_gpu),
    each pod given its own with CUDA_VISIBLE_DEVICES; False where chips are simulated, or where
    the engine's hosts give each process its GPUs themselves."""
    nodes_come_back: bool = False
    """Nodes lost or isolated are replaced by the scheduler when the job is queued again (a
    requeued Slurm job gets a new allocation): a job with no node left for its last level stops
    to be resumed rather than failing (R-44)."""
    nodes_share_cores: bool = False
    """Every node of the cluster is this one machine (the embedded cluster): the pods of all
    nodes share its cores, as the processes of one torchrun host do."""


@dataclass(frozen=True)
class LeftBehind:
    """What the pods left behind in their containers, counted by the engine's shutdown."""

    count: int | None
    """Processes still in the pods' cgroups once every launcher and agent had exited (0: each
    pod ended all it started; None where pods are not cgroups)."""
    what: tuple[str, ...] = ()
    """Those processes in words (`cgroup: name (state)`), where the engine can tell."""


NOTHING_COUNTED = LeftBehind(None)


@dataclass(frozen=True)
class Settled:
    """A recovery that ended, as the engine is told of it (where the engine's own record of the
    job has a place for it: a Kubernetes Event on the pods it touched)."""

    action: str
    """Its level (`pod-reschedule`)."""
    succeeded: bool
    fault: str
    """The fault it answered, in words (`node-lost (node n1)`)."""
    pods: tuple[int, ...]
    """The pods it rebuilt or restarted (empty: every pod of the job)."""
    took_s: float | None
    """From the fault to progress again, where it succeeded."""


class Rehearsal(Protocol):
    """A fault plan's faults that only the engine can make real: a node lost, a link cut."""

    def kill_node(self, node: str) -> None:
        """Lose a node (the fault plan's node-down): its agent and every pod on it die at once."""
        ...

    def inject_link_fault(
        self,
        node: str,
        kind: LinkFaultKind,
        duration_s: float | None,
        cut: Cut | None = None,
        rate_mbit: float | None = None,
    ) -> str | None:
        """A link fault on `node`, made real for `duration_s`; why not, where the engine cannot
        (the controller then simulates a link down, or records it not fired)."""
        ...


class NoRehearsal:
    """An engine that cannot lose a node or cut a link on purpose says why."""

    def __init__(self, why: str) -> None:
        self.why = why

    def kill_node(self, node: str) -> None:
        raise NotImplementedError(f"node-down on {node}: {self.why}")

    def inject_link_fault(
        self,
        node: str,
        kind: LinkFaultKind,
        duration_s: float | None,
        cut: Cut | None = None,
        rate_mbit: float | None = None,
    ) -> str | None:
        return self.why


class Engine(Protocol):
    """Starts and ends the processes of a job on the nodes of a cluster: the controller's port."""

    @property
    def facts(self) -> EngineFacts:
        """What this engine is (its chips, pods and networks), as data."""
        ...

    @property
    def bind_host(self) -> str:
        """The address the controller listens on: one every node can reach."""
        ...

    @property
    def listen_port(self) -> int:
        """The port the controller listens on (0: any free one; its address is written to the
        state directory, where the agents and launchers find it)."""
        ...

    @property
    def rehearsal(self) -> Rehearsal:
        """How this engine makes a fault plan's node and link faults real."""
        ...

    def listening(self, host: str, port: int) -> None:
        """The controller listens at host:port now (a resumed one at a port of its own): where
        an engine whose nodes find the controller through it says so (Kubernetes: a Lease)."""
        ...

    def settled(self, recovery: Settled) -> None:
        """A recovery ended (its record is stored): told where the engine keeps a record of its
        own; it must not block the controller's loop."""
        ...

    def start_agent(self, node: NodeSpec, interval: float, grace: float, blip_s: float) -> int:
        """Start the node agent of `node` (its heartbeat and chip health); its pid."""
        ...

    def start_pod(self, plan: LaunchPlan) -> int:
        """Start a pod's launcher on `plan.node` in `plan.workdir`; its pid (-1 where the node's
        agent starts it: cluster.hosted)."""
        ...

    def agent_heard(self, node: str, peer: Any, message: AgentHello | Heartbeat) -> None:
        """What a node's agent said (its hello, each heartbeat), as the controller read it:
        where agents start their node's pods, the connection that reaches them."""
        ...

    def assumed(self, job: int, node: str, pod: int, generation: int) -> None:
        """The standby launcher on `node` became the launcher of `pod`."""
        ...

    def lost_nodes(self) -> Mapping[str, str]:
        """Nodes the engine itself knows to be gone (besides a silent agent), each with what the
        engine saw, in words ("": only that it is gone); non-blocking."""
        ...

    def isolate_node(self, node: str, reason: str) -> str | None:
        """relaunch took `node` out (isolated it, or lost it): told to the scheduler that owns
        it, where there is one (Slurm drains it); why it could not be, said once by the
        caller."""
        ...

    def node_address(self, node: str) -> str:
        """An address of `node` the other nodes reach (MASTER_ADDR when rank 0 is there)."""
        ...

    def free_port(self, node: str) -> int:
        """A TCP port free on `node` now (MASTER_PORT when rank 0 is there)."""
        ...

    def pod_environment(self, node: str) -> dict[str, str]:
        """What the engine adds to the environment of a pod's processes on `node` (the job's
        own environment wins)."""
        ...

    def shutdown(self) -> LeftBehind:
        """End everything this engine started and still runs; what the pods left behind."""
        ...


class EngineBase:
    """The port's defaults: an engine states only what it does differently. Its nodes reach the
    controller on the loopback, no scheduler owns them, it sees no node die by itself, and it
    rehearses no node or link fault."""

    @property
    def bind_host(self) -> str:
        return "127.0.0.1"

    @property
    def listen_port(self) -> int:
        return 0

    @property
    def facts(self) -> EngineFacts:
        raise NotImplementedError(f"{type(self).__name__} says what it is (EngineFacts)")

    @property
    def rehearsal(self) -> Rehearsal:
        return NoRehearsal(f"{type(self).__name__} cannot lose a node or cut a link on purpose")

    def listening(self, host: str, port: int) -> None:
        return None

    def settled(self, recovery: Settled) -> None:
        return None

    def agent_heard(self, node: str, peer: Any, message: AgentHello | Heartbeat) -> None:
        return None

    def assumed(self, job: int, node: str, pod: int, generation: int) -> None:
        return None

    def lost_nodes(self) -> Mapping[str, str]:
        return {}

    def isolate_node(self, node: str, reason: str) -> str | None:
        return None

    def node_address(self, node: str) -> str:
        return "127.0.0.1"

    def free_port(self, node: str) -> int:
        from relaunch.cluster.local import free_port

        return free_port()

    def pod_environment(self, node: str) -> dict[str, str]:
        return {}

    def shutdown(self) -> LeftBehind:
        return NOTHING_COUNTED
