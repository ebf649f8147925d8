"""The engines by name: where `relaunch run`, `relaunch server`, `relaunch nodes` and the runner
find the engine a job runs on.

An engine is two things: its :class:`~relaunch.cluster.Engine`, the port the controller drives
(start a node's agent or a pod, lost nodes, isolation, addresses), and its :class:`EngineKind`
here, what the commands ask of it before and after a controller runs (where a new job's nodes
are, how a stored job's engine opens again, its nodes beside relaunch's). Each engine is one
module of this package with its kind; :data:`BUILT_IN` names them, and a package of its own adds
one with an entry point in the group ``relaunch.engines`` (``name = "module:Kind"``), or a test
with :func:`register`. Nothing here imports an engine until it is asked for by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from relaunch.errors import EngineError

if TYPE_CHECKING:
    from relaunch.cluster import Engine
    from relaunch.cluster.config import ClusterConfig
    from relaunch.spec import JobSpec
    from relaunch.store import NodeRow, Store

__all__ = [
    "BUILT_IN",
    "EngineKind",
    "NodesTable",
    "Opening",
    "Placement",
    "Trial",
    "Where",
    "kind",
    "kind_of_stored",
    "names",
    "register",
]

BUILT_IN: dict[str, str] = {
    "embedded": "relaunch.engines.embedded:EmbeddedKind",
    "ray": "relaunch.engines.ray:RayKind",
    "slurm": "relaunch.engines.slurm:SlurmKind",
    "agents": "relaunch.engines.agents:AgentsKind",
    "kubernetes": "relaunch.engines.kubernetes:KubernetesKind",
}
"""Each engine's name and its kind, as `module:class` (imported when asked for)."""

ENTRY_POINTS = "relaunch.engines"


class Trial(Protocol):
    """A cluster started for one run (a local Ray cluster), stopped when the run ends."""

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Where:
    """What a command was told about where its jobs run: the options that name a cluster."""

    address: str | None = None
    """--address: a Ray cluster, or the HOST:PORT hand-started agents were given."""
    select: str | None = None
    """--ray-select: the Ray nodes to use."""
    cluster_file: Path | None = None
    """--cluster, where the job's nodes are written (the embedded cluster)."""
    kubeconfig: Path | None = None
    """--kubeconfig: the Kubernetes cluster (default: $KUBECONFIG)."""
    namespace: str | None = None
    """--namespace: where a job's Kubernetes objects go (default: `default`)."""
    serving: bool = False
    """For `relaunch server`, whose jobs come later (no job yet, nothing to start a trial for)."""


@dataclass
class Placement:
    """A new job's place on an engine, decided before the job is stored."""

    cluster: Any
    """The cluster settings, with this engine's nodes."""
    stored: dict[str, Any] | None
    """What the job keeps of its engine (`{"kind": name, ...}`; None: the embedded cluster),
    from which the runner opens it again (:meth:`EngineKind.open`)."""
    trial: Trial | None = None


@dataclass(frozen=True)
class Opening:
    """What the runner gives an engine to open on: a stored job's state and its cluster."""

    directory: Path
    store: Store
    cluster: ClusterConfig
    remove_node: Callable[[str], None] | None = None
    """How a trial cluster loses a node (the fault plan's node-down on Ray's trial)."""
    requeued: bool = False
    """The job stopped for want of nodes and runs again (a requeued Slurm job's new allocation)."""


@dataclass(frozen=True)
class NodesTable:
    """`relaunch nodes --engine NAME`: the engine's word on each node beside relaunch's."""

    columns: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)


class EngineKind:
    """One engine, as the commands see it (see the module docstring). A kind states its name,
    its one line of help, and what it does differently from these defaults: a new job's nodes
    are the cluster settings' as given, and `relaunch nodes` shows relaunch's own table."""

    name: ClassVar[str]
    summary: ClassVar[str]
    """What it runs on, in a few words (`--engine`'s help)."""
    takes_address: ClassVar[bool] = False
    takes_select: ClassVar[bool] = False
    serves: ClassVar[bool] = False
    """`relaunch server` runs its jobs on it."""

    def place(
        self, cluster_raw: Any, job: JobSpec | None, where: Where, say: Callable[[str], None]
    ) -> Placement:
        return Placement(cluster_raw, {"kind": self.name})

    def open(self, stored: Mapping[str, Any], at: Opening) -> tuple[Engine, ClusterConfig]:
        """The engine of a stored job (its `stored` settings), and the job's cluster on it."""
        raise NotImplementedError

    def nodes(self, where: Where, known: Mapping[str, NodeRow]) -> NodesTable | None:
        """The engine's nodes with its state of each beside relaunch's (`known`); None: only
        relaunch's own table."""
        return None


_kinds: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> None:
    """Add (or replace) an engine by its kind's name."""
    _kinds[kind.name] = kind


def _declared() -> dict[str, str]:
    found = dict(BUILT_IN)
    for point in entry_points(group=ENTRY_POINTS):
        found.setdefault(point.name, point.value)
    return found


def names() -> list[str]:
    """Every engine's name: the built-in ones in their order, then plug-ins and registered."""
    return list(dict.fromkeys([*_declared(), *_kinds]))


def kind(name: str) -> EngineKind:
    """The engine named `name`; EngineError for a name no engine has."""
    if name not in _kinds:
        target = _declared().get(name)
        if target is None:
            raise EngineError(f"--engine {name}: choose {_choices()}")
        module, _, attribute = target.partition(":")
        register(getattr(importlib.import_module(module), attribute)())
    return _kinds[name]


def kind_of_stored(stored: Mapping[str, Any] | None) -> EngineKind:
    """The engine a stored job was submitted to (none stored: the embedded cluster)."""
    return kind(str(stored.get("kind", "embedded")) if stored else "embedded")


def _choices() -> str:
    every = names()
    return ", ".join(every[:-1]) + f" or {every[-1]}" if len(every) > 1 else every[0]
