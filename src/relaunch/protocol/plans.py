"""What a launcher is told to run (the launch plan), and the process group's membership.

Both are written to files in the pod's directory and read by other processes, so each has one
definition and one serialisation. Standard library only (the SDK reads the membership).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from relaunch.protocol.codec import from_data, to_data

__all__ = ["FRAMEWORK_MINDSPORE", "LaunchPlan", "Membership", "read_membership", "write_atomically"]


FRAMEWORK_MINDSPORE: Final = "mindspore"


@dataclass(frozen=True)
class LaunchPlan:
    """A pod's launcher: what to run, where, and how to supervise it (the pod's launch.json)."""

    job: int
    pod: int
    """-1 for a standby launcher."""
    generation: int
    node: str
    command: tuple[str, ...]
    procs_per_pod: int
    first_rank: int
    working_dir: str | None
    monitor_interval_s: float
    adopt_grace_s: float
    workdir: str
    env: dict[str, str] = field(default_factory=dict)
    host_processes: int = 0
    """The job's processes that share the node's cores: its pod's, or, where every node is one
    machine (the embedded cluster), the whole job's. Over one, each takes one OpenMP thread
    unless the job says otherwise, as under torchrun (0: the pod's, a plan written before)."""
    warm_spares: int = 0
    """Processes kept started (Python up, torch imported) for process-level restarts."""
    spares_at_once: bool = True
    """The spares start together while none of the pod's ranks trains (reported a step); False:
    always one at a time (a standby launcher started while the job trains, see SparePool)."""
    progress_interval_s: float = 0.02
    """At most one progress message per this interval (the controller scales it with the job)."""
    termination_grace_s: float = 30.0
    """SIGTERM -> SIGKILL grace the job asks for: used when the pod is abandoned."""
    activity_interval_s: float = 1.0
    """How often each rank's CPU time and I/O are sampled and sent (hang detection, R-25)."""
    lease_s: float | None = None
    """R-14: a launcher that hears nothing from its controller for this long (a `Lease` comes
    every quarter of it) stops its processes, as one whose connection closed does after
    `adopt_grace_s`. None: only a closed connection counts."""
    job_name: str = ""
    """The job's name (a Kubernetes Pod's name and its `relaunch.io/job` label)."""
    framework: str = "pytorch"
    """The job's framework (the spec's `framework` label): FRAMEWORK_MINDSPORE gives each rank
    msrun's variables and pod 0's launcher MindSpore's scheduler (launcher.mindspore)."""
    standby: bool = False
    """A launcher on a standby node that runs no rank yet: it keeps `warm_spares` processes
    ready and becomes a pod's launcher when the controller moves a pod to its node ("assume")."""

    def to_json(self) -> str:
        return json.dumps(to_data(self))

    @classmethod
    def from_json(cls, text: str) -> LaunchPlan:
        return from_data(cls, json.loads(text))


@dataclass(frozen=True)
class Membership:
    """One generation of a job's process group (process-level recovery, see train.group).

    The same membership goes to every pod's launcher: it names the pods in the group as runs of
    consecutive pods whose containers share a generation (`containers`), so that it stays a few
    hundred bytes for thousands of pods; `pods` and `ranks` are derived from them."""

    generation: int
    addr: str
    port: int
    world_size: int
    containers: tuple[tuple[int, int, int], ...] = ()
    """The pods in the group, in order, as runs: (first pod, how many, their container's
    generation). Their ranks, numbered densely in that order, form the group."""
    joiners: tuple[int, ...] = ()
    """Original ranks that start from nothing in this generation and receive the state."""
    retry: bool = False
    """An online retry: same group, every rank runs the current step again."""
    suspects: tuple[int, ...] = ()
    """Original ranks whose memory the fault may have touched (a chip's memory error): in an
    online retry they take model and optimizer from a healthy replica (train.group's
    `rollback="replica"`)."""
    parked: tuple[int, ...] = ()
    """Pods left out by an elastic scale-in, until a node takes them back."""
    procs_per_pod: int = 1
    operator: tuple[int, int, int] | None = None
    """R-29, an order to issue a failed collective again: (step, collective, attempt). The same
    ranks form a group anew on this generation's store and issue again, from that collective
    on, every collective they had issued since; nothing is rolled back. Not a generation of the
    keeper's own group."""

    @classmethod
    def of_pods(cls, pods: Mapping[int, int], procs_per_pod: int, **fields: Any) -> Membership:
        """The membership of `pods` (pod index -> its container's generation, in group order)."""
        runs: list[list[int]] = []
        for pod, generation in pods.items():
            last = runs[-1] if runs else None
            if last is not None and last[0] + last[1] == pod and last[2] == generation:
                last[1] += 1
            else:
                runs.append([pod, 1, generation])
        return cls(
            containers=tuple((first, count, gen) for first, count, gen in runs),
            world_size=len(pods) * procs_per_pod,
            procs_per_pod=procs_per_pod,
            **fields,
        )

    @functools.cached_property
    def pods(self) -> dict[int, int]:
        """Pod index -> the generation of its container: a process of an older container is
        stale."""
        return {
            pod: generation
            for first, count, generation in self.containers
            for pod in range(first, first + count)
        }

    @functools.cached_property
    def ranks(self) -> dict[int, int]:
        """Original rank (RANK at start) -> rank in this generation."""
        ppp = self.procs_per_pod
        members = (pod * ppp + local for pod in self.pods for local in range(ppp))
        return {rank: i for i, rank in enumerate(members)}

    def to_json(self) -> str:
        return json.dumps(to_data(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Membership:
        return from_data(cls, data)


def read_membership(path: Path) -> Membership | None:
    """The membership in `path`; None while it is absent or being replaced."""
    try:
        return Membership.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename: a reader sees the old or the new, never half."""
    partial = path.with_name(f".{path.name}.part-{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
