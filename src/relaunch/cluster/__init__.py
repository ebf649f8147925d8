"""Cluster engines: where pods run. `local` is the embedded default; `ray` runs the same agents
and launchers on the nodes of a Ray cluster (optional: `pip install relaunch[ray]`); `slurm`
runs them inside a Slurm allocation, each node's agent a step that starts its node's pods.

The controller talks to an engine only through :class:`Engine`; nothing here imports Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping

    from relaunch.cluster.config import NodeSpec
    from relaunch.protocol.links import Cut, LinkFaultKind
    from relaunch.protocol.messages import AgentHello, Heartbeat
    from relaunch.protocol.plans import LaunchPlan

__all__ = ["Engine"]


class Engine(Protocol):
    """Starts and kills the processes of a job on the nodes of a cluster."""

    @property
    def bind_host(self) -> str:
        """The address the controller listens on: one every node can reach."""
        ...

    @property
    def listen_port(self) -> int:
        """The port the controller listens on (0: any free one; its address is written to the
        state directory, where the agents and launchers find it)."""
        ...

    left_behind: int | None
    """After `shutdown`: how many processes the pods left in their cgroups (0 when every pod
    ended all it started; None where pods are not cgroups)."""

    left_behind_what: list[str]
    """Those processes in words (`cgroup: name (state)`), where the engine can tell."""

    @property
    def chips_are_gpus(self) -> bool:
        """A node's chips are the machine's NVIDIA GPUs (node by node: ClusterConfig's
        first_gpu), and each pod is given its own with CUDA_VISIBLE_DEVICES; False where chips
        are simulated, or where the engine's hosts give each process its GPUs themselves."""
        ...

    @property
    def chips(self) -> str:
        """What a node's chips are on this engine (GPUs, or simulated and why), in words."""
        ...

    @property
    def nodes_come_back(self) -> bool:
        """Nodes lost or isolated are replaced by the scheduler when the job is queued again (a
        requeued Slurm job gets a new allocation): a job with no node left for its last level
        stops to be resumed rather than failing (R-44)."""
        ...

    @property
    def nodes_share_cores(self) -> bool:
        """Every node of the cluster is this one machine (the embedded cluster): the pods of all
        nodes share its cores, as the processes of one torchrun host do."""
        ...

    @property
    def containers(self) -> str:
        """What a pod is on this engine (cgroups or process groups, and why), in words."""
        ...

    @property
    def networks(self) -> str:
        """What a node's network is on this engine (and which link faults are real), in words."""
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

    def isolate_node(self, node: str, reason: str) -> str | None:
        """relaunch took `node` out (isolated it, or lost it): told to the scheduler that owns
        it, where there is one (Slurm drains it); why it could not be, said once by the
        caller."""
        ...

    def assumed(self, job: int, node: str, pod: int, generation: int) -> None:
        """The standby launcher on `node` became the launcher of `pod`."""
        ...

    def kill_node(self, node: str) -> None:
        """Lose a node (the fault plan's node-down): its agent and every pod on it die at once."""
        ...

    def shutdown(self) -> None:
        """Kill everything this engine started and is still running."""
        ...

    def lost_nodes(self) -> Mapping[str, str]:
        """Nodes the engine itself knows to be gone (besides a silent agent), each with what the
        engine saw, in words ("": only that it is gone); non-blocking."""
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

    def inject_link_fault(
        self,
        node: str,
        kind: LinkFaultKind,
        duration_s: float | None,
        cut: Cut | None = None,
        rate_mbit: float | None = None,
    ) -> str | None:
        """A fault plan's link fault on `node`, made real for `duration_s`; why not, where the
        engine cannot (the controller then simulates a link down, or records it not fired)."""
        ...
