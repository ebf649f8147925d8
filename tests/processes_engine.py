"""An engine of the tests' own, written as a new engine is (docs/architecture.md, "Adding an
engine"): this one module, registered by name. Its nodes are plain processes on this machine:
each node's agent is started by the engine with `--hosts-pods` and starts its node's pods itself
(cluster.hosted), as Slurm's steps do, but with no scheduler, no cgroups and no network of its
own. What it does not say, the port's defaults say (cluster.EngineBase)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relaunch.cluster import EngineFacts, LeftBehind
from relaunch.cluster.config import ClusterConfig, NodeSpec
from relaunch.cluster.hosted import AgentsCluster
from relaunch.engines import EngineKind, Opening
from relaunch.protocol.wire import controller_address

__all__ = ["ProcessesKind"]


class Processes(AgentsCluster):
    def __init__(self, directory: Path) -> None:
        super().__init__("127.0.0.1", 0)
        self.directory = directory
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def facts(self) -> EngineFacts:
        return EngineFacts(
            chips="chips are simulated",
            containers="pods are process groups started by their node's agent",
            networks="nodes share the loopback",
            nodes_share_cores=True,
        )

    def start_agent(self, node: NodeSpec, interval: float, grace: float, blip_s: float) -> int:
        address = controller_address(self.directory)
        assert address is not None, "the controller listens before agents start"
        log = open(self.directory / f"agent-{node.name}.log", "a")  # noqa: SIM115
        self.agents[node.name] = subprocess.Popen(
            [sys.executable, "-m", "relaunch.cluster.agent", "--state-dir", str(self.directory),
             "--node", node.name, "--chips", str(node.chips), "--interval", str(interval),
             "--grace", str(grace), "--blip", str(blip_s), "--simulate-chips", "--hosts-pods",
             "--controller", f"{address[0]}:{address[1]}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        return self.agents[node.name].pid

    def lost_nodes(self) -> Mapping[str, str]:
        return {
            n: "its agent exited" for n, agent in self.agents.items() if agent.poll() is not None
        }

    def shutdown(self) -> LeftBehind:
        for agent in self.agents.values():  # told to end: they end their pods, then exit
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        return super().shutdown()


class ProcessesKind(EngineKind):
    name = "test-processes"
    summary = "plain processes on this machine (the tests' own engine)"

    def open(self, stored: Mapping[str, Any], at: Opening) -> tuple[Processes, ClusterConfig]:
        return Processes(at.directory), at.cluster
