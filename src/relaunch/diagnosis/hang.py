"""Which rank a hung job waits for. When one rank stops (a SIGSTOP, a debugger, a deadlock in its
own code, an endless loop) its peers stop at their next collective and wait: every rank is silent,
so silence alone cannot name the culprit. Their Python stacks can: the ranks that wait show a
collective (or DDP's backward, whose hooks all-reduce) at the top of their stack; the culprit is
stopped, or somewhere else.

Ranks whose stacks are alike (most of a hung job's: they wait in one collective) are one
`StackGroup`: sent once by their launcher, stored once with the fault, read once by a person."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "COLLECTIVES",
    "Frame",
    "HangFinding",
    "RankStack",
    "StackGroup",
    "culprits",
    "group_stacks",
    "in_rendezvous",
    "ranks_text",
    "waits_in_collective",
]

COLLECTIVES: Final = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
        "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
        "monitored_barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
        "send", "recv", "isend", "irecv", "batch_isend_irecv", "wait", "new_group",
        "init_process_group", "_store_based_barrier", "rendezvous",
    }
)  # fmt: skip
"""torch.distributed functions in which a rank waits for its peers."""
RENDEZVOUS: Final = frozenset(
    {
        "init_process_group", "_create_c10d_store", "_env_rendezvous_handler",
        "_tcp_rendezvous_handler", "_file_rendezvous_handler", "rendezvous",
        "_store_based_barrier",
    }
)  # fmt: skip
"""torch.distributed functions in which a rank builds its group: it waits for peers that may
still start (import, connect), which is its startup, not a hang."""
_BACKWARD: Final = frozenset({"backward", "_engine_run_backward", "run_backward"})
"""Autograd's backward, where DDP and FSDP hooks run their collectives."""
_DISTRIBUTED_FILES: Final = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"


@dataclass(frozen=True)
class RankStack:
    """One rank's Python process as captured: its state (psutil's: "stopped", "sleeping",
    "running", ...), its main thread's frames (innermost first), the whole dump as text, and
    why there is none, if there is none."""

    rank: int
    pid: int
    state: str
    frames: tuple[Frame, ...] = ()
    text: str = ""
    error: str = ""


@dataclass(frozen=True)
class StackGroup:
    """Ranks whose stacks are alike: one state, the same frames, text and error; each rank's pid
    beside it (`pids[i]` is `ranks[i]`'s)."""

    ranks: tuple[int, ...]
    pids: tuple[int, ...]
    state: str
    frames: tuple[Frame, ...] = ()
    text: str = ""
    error: str = ""


def group_stacks(stacks: Iterable[RankStack | StackGroup]) -> tuple[StackGroup, ...]:
    """The stacks (one rank's, or groups already) as groups of alike ones, each group's ranks in
    order, the groups in the order of their first rank."""
    grouped: dict[tuple[str, tuple[Frame, ...], str, str], dict[int, int]] = {}
    for s in stacks:
        pairs = (
            zip(s.ranks, s.pids, strict=True) if isinstance(s, StackGroup) else [(s.rank, s.pid)]
        )
        grouped.setdefault((s.state, s.frames, s.text, s.error), {}).update(pairs)
    groups = [
        StackGroup(tuple(sorted(pids)), tuple(pids[r] for r in sorted(pids)), *key)
        for key, pids in grouped.items()
    ]
    return tuple(sorted(groups, key=lambda g: g.ranks[0]))


@dataclass(frozen=True)
class HangFinding:
    culprits: tuple[int, ...]
    reason: str
    forming: bool = False
    """Every rank was read building its group (`in_rendezvous`): they wait for peers that still
    start, which is the startup allowance's to time, not the hang window's."""


def in_rendezvous(frames: Sequence[Frame]) -> bool:
    """torch.distributed's rendezvous (`init_process_group` and the store it connects) is on the
    stack."""
    return any(
        frame.function in RENDEZVOUS and "torch/distributed/" in frame.file.replace("\\", "/")
        for frame in frames
    )


def waits_in_collective(frames: Sequence[Frame]) -> bool:
    """A torch.distributed collective (or autograd's backward, where DDP all-reduces) is on the
    stack."""
    for frame in frames:
        path = frame.file.replace("\\", "/")
        if not any(part in path for part in _DISTRIBUTED_FILES):
            continue
        if frame.function in COLLECTIVES or frame.function in _BACKWARD:
            return True
    return False


def culprits(stacks: Sequence[RankStack | StackGroup]) -> HangFinding:
    """The ranks the others wait for: the stopped ones; else none if every rank was read in its
    rendezvous (`forming`: waiting for peers to start); else those not waiting in a collective
    while others are; else none can be named (every rank waits: a peer outside the job, the
    network, or ranks that called different collectives)."""
    groups = [
        s
        if isinstance(s, StackGroup)
        else StackGroup((s.rank,), (s.pid,), s.state, s.frames, s.text, s.error)
        for s in stacks
    ]
    if not groups:
        return HangFinding((), "no rank's stack could be captured")
    stopped = _ranks_of(g for g in groups if g.state in ("stopped", "tracing-stop"))
    if stopped:
        return HangFinding(
            stopped,
            f"{ranks_text(stopped)} stopped (SIGSTOP or a debugger); the others wait for it",
        )
    read = [g for g in groups if g.frames]
    if len(read) == len(groups) and all(in_rendezvous(g.frames) for g in read):
        return HangFinding(
            (),
            "every rank builds its group (init_process_group): they wait for peers that still "
            "start",
            forming=True,
        )
    waiting = [g for g in read if waits_in_collective(g.frames)]
    others = [g for g in read if not waits_in_collective(g.frames)]
    if waiting and others:
        elsewhere = _ranks_of(others)
        where = next(g for g in others if elsewhere[0] in g.ranks).frames[0]
        return HangFinding(
            elsewhere,
            f"{ranks_text(elsewhere)} not in a collective (rank {elsewhere[0]} "
            f"is in {where}) while {ranks_text(_ranks_of(waiting))} wait in one",
        )
    if waiting:
        return HangFinding(
            (),
            "every rank waits in a collective: a peer outside the job, the network, or mismatched collectives",
        )
    if not read:
        errors = sorted({g.error for g in groups if g.error})
        return HangFinding(
            (), "no stack could be read" + (f": {'; '.join(errors)}" if errors else "")
        )
    return HangFinding(
        (), "no rank waits in a collective: the job may be stuck outside torch.distributed"
    )


def _ranks_of(groups: Iterable[StackGroup]) -> tuple[int, ...]:
    return tuple(sorted(r for g in groups for r in g.ranks))


def ranks_text(ranks: Sequence[int]) -> str:
    """ "rank 3", "ranks 0, 2", or runs: "ranks 0-1023, 1025-4095 (4,095)": readable at any
    number of ranks (a hung job's thousands of waiting ranks are a run or two)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    parts = [
        f"{a}-{b}" if b - a >= 2 else ", ".join(str(r) for r in range(a, b + 1)) for a, b in runs
    ]
    count = f" ({len(ranks):,})" if len(ranks) > 3 and len(parts) < len(ranks) else ""
    return "ranks " + ", ".join(parts) + count
