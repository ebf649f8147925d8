"""Machines whose agents an operator started by hand (cluster.hosted)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relaunch.engines import EngineKind, Opening, Placement, Where
from relaunch.errors import InputError, Problem

if TYPE_CHECKING:
    from relaunch.cluster import Engine
    from relaunch.cluster.config import ClusterConfig
    from relaunch.spec import JobSpec

__all__ = ["AgentsKind"]


class AgentsKind(EngineKind):
    name = "agents"
    summary = "agents started by hand (`relaunch agent`)"
    takes_address = True

    def place(
        self, cluster_raw: Any, job: JobSpec | None, where: Where, say: Callable[[str], None]
    ) -> Placement:
        """Where the controller listens for the agents an operator started (`relaunch agent
        --controller HOST:PORT`): --address HOST:PORT."""
        host, _, port = (where.address or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(
                "relaunch run",
                [
                    Problem(
                        "--address",
                        where.address,
                        "HOST:PORT the agents were given (--engine agents)",
                    )
                ],
            )
        return Placement(
            cluster_raw, {"kind": self.name, "host": host.strip("[]"), "port": int(port)}
        )

    def open(self, stored: Mapping[str, Any], at: Opening) -> tuple[Engine, ClusterConfig]:
        from relaunch.cluster.hosted import AgentsCluster

        return AgentsCluster(str(stored["host"]), int(stored["port"])), at.cluster
