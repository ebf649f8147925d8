"""Fault plans: faults to inject into a running job, so that users can rehearse failures.

A plan is YAML or JSON::

    faults:
      - {kind: process-exit, at_step: 20, pod: 1, exit_code: 1}
      - {kind: chip-fault, after_s: 5, pod: 0, chip: 0, code: 80E18005, heals: true}
      - {kind: node-down, at_step: 60, pod: 1}
      - {kind: hang, at_step: 80, pod: 0, rank: 1}
      - {kind: hang, at_step: 90, pod: 1, local_rank: 1}
      - {kind: network, after_s: 3, node: node-2, duration_s: 30}
      - {kind: partition, at_step: 40, pod: 1, cut: peers, duration_s: 15}
      - {kind: degraded-link, at_step: 50, pod: 1, rate_mbit: 2, duration_s: 120}
      - {kind: memory-uce, at_step: 10, pod: 1, chip: 1}
      - {kind: slow, at_step: 30, pod: 1, factor: 3, duration_s: 600}
      - {kind: peer-copy-corrupt, at_step: 30, node: node-1}

`at_step` fires when the job reports that step; `after_s` that many seconds after the current
attempt started. Each entry fires once, in the order listed: an entry due while its rank
(re)starts fires once the rank runs, and the entries after it wait for it. `pod: i` targets the node pod i is on when it fires.
`rank` is a global rank (`RANK`), and must be one of the ranks the pod holds; `local_rank` is a
rank within the pod (`LOCAL_RANK`). `chip` is a chip of the target node. `slow` makes every
process of the pod `factor` times slower (it runs 1/factor of each 0.1 s and is stopped the rest,
a CPU throttle's duty cycle) for `duration_s` (default: until the pod's processes end).
`peer-copy-corrupt` makes the node's peer memory go bad for the job, as a failing memory module
would: one byte of every checkpoint copy it holds of the job, and of every one it receives after,
is flipped. Nothing detects it; a rank that restores from such a copy refuses it (its checksum)
and reads the next tier.

Link faults, for `duration_s` (default: until the job ends), are real where the embedded
cluster's nodes are network namespaces (relaunch.cluster.network): `network` takes the node's data
link down (its carrier goes); `partition` cuts the node off from the `controller` (its management
link), from its `peers` (its data link) or `both`, with blackhole routes both ways; `degraded-link`
limits the node's data link to `rate_mbit` megabits a second. Where nodes share the loopback, a
`network` fault is simulated (the agent reports it; no connection notices) and the others cannot
fire (recorded so).

:func:`parse_plan` checks each entry on its own; :func:`check_plan` checks that every entry can
hit its target in a given job on a given cluster, so that a plan is refused before anything
starts rather than silently dropped at run time. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Final, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from relaunch.errors import FaultPlanError, Problem
from relaunch.faults import normalize_code
from relaunch.protocol.integrity import Corruption, CorruptionTarget
from relaunch.protocol.links import Cut
from relaunch.validation import (
    MAX_PODS,
    boolean,
    choice,
    integer,
    problems_from,
    reject,
    seconds,
    v,
)

if TYPE_CHECKING:
    from relaunch.spec import JobSpec


class PlanNode(Protocol):
    """What a plan is checked against of a cluster's node (relaunch.cluster.config.NodeSpec)."""

    @property
    def name(self) -> str: ...

    @property
    def chips(self) -> int: ...


class PlanCluster(Protocol):
    """What a plan is checked against of a cluster (relaunch.cluster.config.ClusterConfig): the
    pure core names no engine's type."""

    @property
    def nodes(self) -> Sequence[PlanNode]: ...


__all__ = ["MAX_ENTRIES", "PlannedFault", "PlannedFaultKind", "check_plan", "parse_plan"]

MAX_ENTRIES: Final = 1000
"""A plan holds at most this many entries."""
_MAX_STEP: Final = 10**12
_MAX_AFTER_S: Final = 30 * 86400.0


class PlannedFaultKind(StrEnum):
    PROCESS_EXIT = "process-exit"
    CHIP_FAULT = "chip-fault"
    NODE_DOWN = "node-down"
    HANG = "hang"
    NETWORK = "network"
    MEMORY_UCE = "memory-uce"
    SLOW = "slow"
    PARTITION = "partition"
    DEGRADED_LINK = "degraded-link"
    PEER_COPY_CORRUPT = "peer-copy-corrupt"
    SILENT_CORRUPTION = "silent-corruption"
    """One bit of a rank's parameters (or optimizer state) flipped in its memory, once or at
    every step from then on: nothing fails, the replicas drift apart (R-45)."""


_CHIP_KINDS: Final = (PlannedFaultKind.CHIP_FAULT, PlannedFaultKind.MEMORY_UCE)
LINK_KINDS: Final = (
    PlannedFaultKind.NETWORK,
    PlannedFaultKind.PARTITION,
    PlannedFaultKind.DEGRADED_LINK,
)
_PROCESS_KINDS: Final = (
    PlannedFaultKind.PROCESS_EXIT,
    PlannedFaultKind.HANG,
    PlannedFaultKind.SLOW,
    PlannedFaultKind.SILENT_CORRUPTION,
)
_RANK_KINDS: Final = (
    PlannedFaultKind.PROCESS_EXIT,
    PlannedFaultKind.HANG,
    PlannedFaultKind.SILENT_CORRUPTION,
)

_ONLY_FOR: Final[dict[str, tuple[PlannedFaultKind, ...]]] = {
    "rank": _RANK_KINDS,
    "local_rank": _RANK_KINDS,
    "exit_code": (PlannedFaultKind.PROCESS_EXIT,),
    "chip": _CHIP_KINDS,
    "code": _CHIP_KINDS,
    "heals": (*_CHIP_KINDS, PlannedFaultKind.NETWORK),
    "duration_s": (*LINK_KINDS, PlannedFaultKind.SLOW),
    "factor": (PlannedFaultKind.SLOW,),
    "cut": (PlannedFaultKind.PARTITION,),
    "rate_mbit": (PlannedFaultKind.DEGRADED_LINK,),
    "target": (PlannedFaultKind.SILENT_CORRUPTION,),
    "repeat": (PlannedFaultKind.SILENT_CORRUPTION,),
}
"""Keys that mean something only for some kinds: given for another kind, they are an error
rather than silently ignored."""


def _code(value: Any) -> str:
    try:
        return normalize_code(value)
    except (ValueError, TypeError):
        raise reject(
            "a fault code: 8 hex digits like 80E18005 (NPU), XID-<n> like XID-79 or a GPU "
            "condition like GPU-LOST (NVIDIA)"
        ) from None


def _factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 < value <= 100:
        raise reject("a slowdown factor above 1 and at most 100 (3: three times slower)")
    return float(value)


def _rate(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 100_000:
        raise reject("a rate in megabits a second, above 0 and at most 100000 (2: 2 Mbit/s)")
    return float(value)


def _node_name(value: Any) -> str:
    if isinstance(value, str) and 0 < len(value) <= 253 and "\0" not in value:
        return value
    raise reject("a node name, as the cluster lists it")


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Annotated[PlannedFaultKind, v(choice(PlannedFaultKind))]
    at_step: Annotated[int | None, v(integer(0, _MAX_STEP, "steps"))] = None
    after_s: Annotated[float | None, v(seconds(-1e-9, _MAX_AFTER_S))] = None
    pod: Annotated[int | None, v(integer(0, MAX_PODS - 1, "pod index"))] = None
    node: Annotated[str | None, v(_node_name)] = None
    rank: Annotated[int | None, v(integer(0, MAX_PODS * 1024, "global rank"))] = None
    local_rank: Annotated[int | None, v(integer(0, 1023, "rank within the pod"))] = None
    chip: Annotated[int | None, v(integer(0, 64, "chip index"))] = None
    exit_code: Annotated[int, v(integer(1, 255, "exit code"))] = 1
    code: Annotated[str | None, v(_code)] = None
    heals: Annotated[bool, v(boolean)] = True
    duration_s: Annotated[float | None, v(seconds(0, 86400))] = None
    factor: Annotated[float, v(_factor)] = 3.0
    cut: Annotated[Cut | None, v(choice(Cut))] = None
    rate_mbit: Annotated[float | None, v(_rate)] = None
    while_saving: Annotated[bool, v(boolean)] = False
    target: Annotated[CorruptionTarget, v(choice(CorruptionTarget))] = CorruptionTarget.PARAMETER
    repeat: Annotated[bool, v(boolean)] = False


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    faults: list[_Entry] = Field(default_factory=list, max_length=MAX_ENTRIES)


_DEFAULT_CODES = {PlannedFaultKind.CHIP_FAULT: "80E18005", PlannedFaultKind.MEMORY_UCE: "80E01801"}


@dataclass(frozen=True)
class PlannedFault:
    index: int
    kind: PlannedFaultKind
    at_step: int | None
    after_s: float | None
    pod: int | None
    node: str | None
    rank: int | None
    """A global rank (RANK), if the entry names one."""
    chip: int
    exit_code: int
    code: str | None
    heals: bool
    duration_s: float | None
    local_rank: int | None = None
    """A rank within the pod (LOCAL_RANK), if the entry names one that way."""
    factor: float = 3.0
    """`slow`: how many times slower the pod runs."""
    cut: Cut | None = None
    """`partition`: what the node is cut off from."""
    rate_mbit: float | None = None
    """`degraded-link`: the data link's rate."""
    while_saving: bool = False
    """Fires only while a rank says it saves a checkpoint (its step reached too): a fault in a
    save (R-37), whatever the machine's load does to when the save begins."""
    corruption: Corruption = field(default_factory=Corruption)
    """`silent-corruption`: what it flips, once or at every step."""

    @property
    def targets_process(self) -> bool:
        return self.kind in _PROCESS_KINDS

    def due(self, step: int | None, attempt_elapsed_s: float, saving: bool = False) -> bool:
        if self.while_saving and not saving:
            return False
        if self.at_step is not None:
            return step is not None and step >= self.at_step
        return self.after_s is not None and attempt_elapsed_s >= self.after_s

    def target_rank(self, procs_per_pod: int) -> int:
        """The global rank a process entry hits: `rank`, `local_rank` within its pod, or the
        pod's first rank."""
        first = (self.pod or 0) * procs_per_pod
        if self.rank is not None:
            return self.rank
        return first + (self.local_rank or 0)

    def describe(self) -> str:
        trigger = (
            f"at step {self.at_step}" if self.at_step is not None else f"after {self.after_s:g} s"
        )
        if self.while_saving:
            trigger += " while a checkpoint is saved"
        target = f"pod {self.pod}" if self.pod is not None else f"node {self.node}"
        if self.rank is not None:
            target += f" rank {self.rank}"
        elif self.local_rank is not None:
            target += f" local rank {self.local_rank}"
        if self.kind in _CHIP_KINDS:
            target += f" chip {self.chip}"
        kind = self.kind.value
        if self.kind is PlannedFaultKind.SLOW:
            kind = f"slow (x{self.factor:g})"
        elif self.kind is PlannedFaultKind.PARTITION:
            kind = (
                "partition from all" if self.cut is Cut.BOTH else f"partition from its {self.cut}"
            )
        elif self.kind is PlannedFaultKind.DEGRADED_LINK:
            kind = f"degraded link ({self.rate_mbit:g} Mbit/s)"
        elif self.kind is PlannedFaultKind.SILENT_CORRUPTION:
            every = ", at every step" if self.corruption.repeat else ""
            kind = f"silent corruption of a {self.corruption.target.value}{every}"
        elif self.kind is PlannedFaultKind.PEER_COPY_CORRUPT:
            kind = "peer memory corrupted (one byte of each copy)"
        if self.kind in LINK_KINDS and self.duration_s is not None:
            kind += f" for {self.duration_s:g} s"
        return f"{kind} on {target} {trigger}"


def parse_plan(data: Any, *, source: str = "<fault plan>") -> tuple[PlannedFault, ...]:
    """Read a plan (`{faults: [...]}` or a list); :class:`FaultPlanError` lists every problem."""
    if data is None:
        return ()
    if isinstance(data, list):
        data = {"faults": data}
    if not isinstance(data, dict):
        raise FaultPlanError(
            source, [Problem("(top level)", data, "a mapping with a `faults` list")]
        )
    try:
        parsed = _Plan.model_validate(data)
    except ValidationError as error:
        raise FaultPlanError(source, problems_from(error, data, _Plan)) from None
    problems = [p for i, e in enumerate(parsed.faults) for p in _entry_problems(f"faults[{i}]", e)]
    entries = [_entry(i, e) for i, e in enumerate(parsed.faults)]
    if problems:
        raise FaultPlanError(source, problems)
    return tuple(entries)


def _entry_problems(where: str, e: _Entry) -> list[Problem]:
    """What is wrong with one entry on its own: its trigger, its target, keys for other kinds."""
    problems = []
    if (e.at_step is None) == (e.after_s is None):
        problems.append(Problem(f"{where}.at_step", e.at_step, "exactly one of at_step or after_s"))
    if (e.pod is None) == (e.node is None):
        problems.append(Problem(f"{where}.pod", e.pod, "exactly one of pod or node as the target"))
    if e.kind in _PROCESS_KINDS and e.pod is None:
        problems.append(
            Problem(f"{where}.pod", None, f"{e.kind.value} needs a pod (and optionally a rank)")
        )
    if e.rank is not None and e.local_rank is not None:
        problems.append(
            Problem(
                f"{where}.local_rank",
                e.local_rank,
                "either rank (global) or local_rank (within the pod), not both",
            )
        )
    if e.kind is PlannedFaultKind.PARTITION and e.cut is None:
        cuts = ", ".join(c.value for c in Cut)
        problems.append(Problem(f"{where}.cut", None, f"partition needs cut: one of {cuts}"))
    if e.kind is PlannedFaultKind.DEGRADED_LINK and e.rate_mbit is None:
        problems.append(
            Problem(f"{where}.rate_mbit", None, "degraded-link needs rate_mbit (megabits a second)")
        )
    for key, kinds in _ONLY_FOR.items():
        if key in e.model_fields_set and e.kind not in kinds:
            names = " or ".join(k.value for k in kinds)
            problems.append(Problem(f"{where}.{key}", getattr(e, key), f"{key} only for {names}"))
    return problems


def _entry(index: int, e: _Entry) -> PlannedFault:
    return PlannedFault(
        index=index,
        kind=e.kind,
        at_step=e.at_step,
        after_s=e.after_s,
        pod=e.pod,
        node=e.node,
        rank=e.rank,
        chip=e.chip or 0,
        exit_code=e.exit_code,
        code=e.code or _DEFAULT_CODES.get(e.kind),
        heals=e.heals,
        duration_s=e.duration_s,
        local_rank=e.local_rank,
        factor=e.factor,
        cut=e.cut,
        rate_mbit=e.rate_mbit,
        while_saving=e.while_saving,
        corruption=Corruption(e.target, e.repeat),
    )


def check_plan(
    entries: Sequence[PlannedFault], job: JobSpec, cluster: PlanCluster
) -> list[Problem]:
    """Every way the plan's entries cannot hit their targets in `job` on `cluster`: a pod the job
    does not have, a rank the pod does not hold, a chip the node lacks, a node the cluster lacks.
    An empty list means every entry can fire (its target may still be gone by then: the job's
    run records that as "not fired")."""
    problems: list[Problem] = []
    ppp = job.procs_per_pod
    nodes = {n.name: n for n in cluster.nodes}
    known = ", ".join(nodes) if len(nodes) <= 16 else f"{', '.join(list(nodes)[:16])}, ..."
    hosts = [n for n in cluster.nodes if n.chips >= job.chips_per_pod]
    for e in entries:
        where = f"faults[{e.index}]"
        if e.pod is not None and e.pod >= job.replicas:
            problems.append(
                Problem(
                    f"{where}.pod",
                    e.pod,
                    f"a pod of job {job.name}: 0 to {job.replicas - 1} ({job.replicas} pod(s))",
                )
            )
            continue
        if e.node is not None and e.node not in nodes:
            problems.append(Problem(f"{where}.node", e.node, f"a node of the cluster: {known}"))
            continue
        if e.targets_process and e.pod is not None:
            problems += _rank_problems(where, e, e.pod, ppp)
        if e.kind is PlannedFaultKind.PEER_COPY_CORRUPT and not job.peer_memory_mb:
            problems.append(
                Problem(
                    f"{where}.kind",
                    e.kind.value,
                    f"a fault of a kind job {job.name} can meet: it keeps no checkpoint copies "
                    "in peer memory (spec.peer_memory_mb)",
                )
            )
        if e.kind in _CHIP_KINDS:
            problem = _chip_problem(where, e, nodes, hosts)
            if problem is not None:
                problems.append(problem)
    return problems


def _rank_problems(where: str, e: PlannedFault, pod: int, ppp: int) -> list[Problem]:
    """A process entry's rank must be one its pod holds."""
    problems = []
    first, last = pod * ppp, pod * ppp + ppp - 1
    held = f"{first}" if first == last else f"{first} to {last}"
    if e.rank is not None and not first <= e.rank <= last:
        problems.append(
            Problem(
                f"{where}.rank",
                e.rank,
                f"a global rank that pod {pod} holds: {held} (rank is global, as "
                f"RANK; use local_rank 0 to {ppp - 1} for a rank within the pod)",
            )
        )
    if e.local_rank is not None and e.local_rank >= ppp:
        problems.append(
            Problem(
                f"{where}.local_rank",
                e.local_rank,
                f"a rank within the pod: 0 to {ppp - 1} ({ppp} process(es) per pod)",
            )
        )
    return problems


def _chip_problem(
    where: str, e: PlannedFault, nodes: dict[str, Any], hosts: Sequence[Any]
) -> Problem | None:
    """A chip entry's chip must exist on its node, or on every node its pod can run on."""
    if e.node is not None:
        chips = int(nodes[e.node].chips)
        what = f"node {e.node} has {chips} chip(s)"
    else:
        if not hosts:
            return None  # the job does not fit at all: its own check says so
        chips = min(int(n.chips) for n in hosts)
        what = f"the smallest node pod {e.pod} can run on has {chips} chip(s)"
    if chips == 0:
        return Problem(f"{where}.chip", e.chip, f"a chip of the target node; {what}")
    if e.chip >= chips:
        return Problem(f"{where}.chip", e.chip, f"a chip index from 0 to {chips - 1}; {what}")
    return None
