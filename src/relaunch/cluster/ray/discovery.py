"""The Ray cluster's nodes as relaunch names them, and connecting to the cluster."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field

import psutil
import ray

from relaunch.errors import EngineError

__all__ = [
    "CALL_TIMEOUT_S",
    "CHIPS_RESOURCE",
    "HEALTH_CHECK",
    "NAMESPACE",
    "NODE_RESOURCE",
    "RayNode",
    "connect",
    "discover",
    "node_environment",
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
        raise EngineError(
            f"cannot reach the Ray cluster at {address}: {error}. Check the address "
            "(`ray status --address ...`), or leave --address out to start a local trial cluster"
        ) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def node_environment() -> dict[str, str]:
    """The node's own environment: the raylet's (as its operator started it), not the one Ray
    gives its workers (Ray sets CUDA_VISIBLE_DEVICES and its own variables there)."""
    try:
        env = dict(psutil.Process(os.getppid()).environ())
    except psutil.Error:
        env = dict(os.environ)
    return {k: v for k, v in env.items() if not k.startswith("RAY_")}
