"""The embedded cluster's shape: which nodes, how many chips, and its detection timings.

A cluster file is YAML or JSON::

    nodes: 5                 # node-0 .. node-4, or a list of {name, chips}
    chips_per_node: 2
    heartbeat_interval_s: 1   # a new chip fault goes at once, not at the next beat
    heartbeat_timeout_s: 3   # a node whose agent is silent this long is Lost
    adopt_grace_s: 30        # pods keep running this long without a controller
    root_cause_window_s: 5   # ranks failing this close to a fault are its collateral
    stack_capture_s: 5       # on a hang, how long to wait for every rank's stack (0: no capture)
    slow_window_s: 60        # a pod busy much more than its peers over this long is slow (0: off)
    slow_margin: 0.3         # ... by at least this share of the window
    pod_lease_s: 30          # R-14: a pod that hears nothing from the controller this long stops
                             # (default: adopt_grace_s); a silent node's pods are replaced after it

Pure: parsing only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from relaunch.errors import InputError, Problem
from relaunch.validation import integer, problems_from, reject, seconds, seconds_or_off, v

__all__ = ["ClusterConfig", "NodeSpec", "parse_cluster"]

_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _node_name(value: Any) -> str:
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    raise reject("a node name of lowercase letters, digits and '-'")


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Annotated[str, v(_node_name)]
    chips: Annotated[int, v(integer(0, 64, "chips"))] = 2


def _share(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise reject("a share of the window between 0 and 1, like 0.3")
    return float(value)


def _nodes(value: Any) -> Any:
    if isinstance(value, list):
        return value
    return integer(1, 256, "nodes, or a list of {name, chips}")(value)


class _ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    nodes: Annotated[int | list[_Node], v(_nodes)] = 4
    chips_per_node: Annotated[int, v(integer(0, 64, "chips"))] = 2
    heartbeat_interval_s: Annotated[float, v(seconds(0, 60))] = 1.0
    heartbeat_timeout_s: Annotated[float, v(seconds(0, 600))] = 3.0
    adopt_grace_s: Annotated[float, v(seconds(0, 86400))] = 30.0
    root_cause_window_s: Annotated[float, v(seconds(0, 600))] = 5.0
    stack_capture_s: Annotated[float, v(seconds_or_off(120))] = 5.0
    slow_window_s: Annotated[float, v(seconds_or_off(86400))] = 60.0
    slow_margin: Annotated[float, v(_share)] = 0.3
    pod_lease_s: Annotated[float | None, v(seconds(0.1, 86400))] = None


@dataclass(frozen=True)
class NodeSpec:
    name: str
    chips: int
    first_gpu: int = field(default=0, compare=False)
    """On the embedded cluster, whose nodes share one machine: this node's chip 0 is the
    machine's GPU `first_gpu` (the chips of the nodes before it come first). Set by
    ClusterConfig."""


@dataclass(frozen=True)
class ClusterConfig:
    nodes: tuple[NodeSpec, ...] = tuple(NodeSpec(f"node-{i}", 2) for i in range(4))
    heartbeat_interval_s: float = 1.0
    """How often an agent says its node is alive: three beats in a timeout (Ray's health check
    allows 5 missed, one every 3 s). A new chip fault is sent at once, and an agent that exits
    is lost the moment its connection closes; only a node that lives but says nothing waits out
    the timeout."""
    heartbeat_timeout_s: float = 3.0
    adopt_grace_s: float = 30.0
    root_cause_window_s: float = 5.0
    """Ranks of the same attempt that fail this close to a fault (by when they failed) are
    recorded as its collateral, answered by its recovery, not decided again."""
    stack_capture_s: float = 5.0
    """On a hang, how long the controller waits for every rank's Python stack before it
    decides (0: no capture)."""
    slow_window_s: float = 60.0
    """A pod whose ranks were busy (not waiting for their peers) `slow_margin` more of this
    window than the other pods', for half a window more, is slow (0: no detection)."""
    slow_margin: float = 0.3
    pod_lease_s: float | None = None
    """R-14: a pod whose launcher hears nothing from the controller this long (a node cut off
    from it, still running) stops its processes; a silent node's pods are replaced only once
    that lease, and the stop's grace, have passed. None: adopt_grace_s."""

    @property
    def lease_s(self) -> float:
        return self.pod_lease_s if self.pod_lease_s is not None else self.adopt_grace_s

    @classmethod
    def sized(cls, nodes: int, chips_per_node: int = 2, **timings: float) -> ClusterConfig:
        specs = tuple(NodeSpec(f"node-{i}", chips_per_node) for i in range(nodes))
        return cls(nodes=specs, **timings)

    def __post_init__(self) -> None:
        first, placed = 0, []
        for node in self.nodes:
            placed.append(replace(node, first_gpu=first))
            first += node.chips
        object.__setattr__(self, "nodes", tuple(placed))


def parse_cluster(data: Any, *, source: str = "<cluster>") -> ClusterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(source, [Problem("(top level)", data, "a mapping of cluster settings")])
    try:
        parsed = _ClusterFile.model_validate(data)
    except ValidationError as error:
        raise InputError(source, problems_from(error, data, _ClusterFile)) from None
    if isinstance(parsed.nodes, int):
        nodes = tuple(NodeSpec(f"node-{i}", parsed.chips_per_node) for i in range(parsed.nodes))
    else:
        nodes = tuple(NodeSpec(n.name, n.chips) for n in parsed.nodes)
    problems = []
    names = [n.name for n in nodes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(Problem("nodes", duplicates, "node names must be unique"))
    if parsed.heartbeat_timeout_s <= parsed.heartbeat_interval_s:
        problems.append(
            Problem(
                "heartbeat_timeout_s",
                parsed.heartbeat_timeout_s,
                f"more than heartbeat_interval_s ({parsed.heartbeat_interval_s:g} s)",
            )
        )
    if problems:
        raise InputError(source, problems)
    return ClusterConfig(
        nodes=nodes,
        heartbeat_interval_s=parsed.heartbeat_interval_s,
        heartbeat_timeout_s=parsed.heartbeat_timeout_s,
        adopt_grace_s=parsed.adopt_grace_s,
        root_cause_window_s=parsed.root_cause_window_s,
        stack_capture_s=parsed.stack_capture_s,
        slow_window_s=parsed.slow_window_s,
        slow_margin=parsed.slow_margin,
        pod_lease_s=parsed.pod_lease_s,
    )
