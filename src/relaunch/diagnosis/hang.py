"""Which rank a hung job waits for. When one rank stops (a SIGSTOP, a debugger, a deadlock in its
own code, an endless loop) its peers stop at their next collective and wait: every rank is silent,
so silence alone cannot name the culprit. Their Python stacks can: the ranks that wait show a
collective (or DDP's backward, whose hooks all-reduce) at the top of their stack; the culprit is
stopped, or somewhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["COLLECTIVES", "Frame", "HangFinding", "RankStack", "culprits", "waits_in_collective"]

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
class HangFinding:
    culprits: tuple[int, ...]
    reason: str


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


def culprits(stacks: Sequence[RankStack]) -> HangFinding:
    """The ranks the others wait for: the stopped ones; else those not waiting in a collective
    while others are; else none can be named (every rank waits: a peer outside the job, the
    network, or ranks that called different collectives)."""
    if not stacks:
        return HangFinding((), "no rank's stack could be captured")
    stopped = tuple(s.rank for s in stacks if s.state in ("stopped", "tracing-stop"))
    if stopped:
        return HangFinding(
            stopped, f"{_ranks(stopped)} stopped (SIGSTOP or a debugger); the others wait for it"
        )
    read = [s for s in stacks if s.frames]
    waiting = [s for s in read if waits_in_collective(s.frames)]
    elsewhere = tuple(s.rank for s in read if not waits_in_collective(s.frames))
    if waiting and elsewhere:
        where = next(s for s in read if s.rank == elsewhere[0]).frames[0]
        return HangFinding(
            elsewhere,
            f"{_ranks(elsewhere)} not in a collective (rank {elsewhere[0]} "
            f"is in {where}) while {_ranks(tuple(s.rank for s in waiting))} wait in one",
        )
    if waiting:
        return HangFinding(
            (),
            "every rank waits in a collective: a peer outside the job, the network, or mismatched collectives",
        )
    if not read:
        errors = sorted({s.error for s in stacks if s.error})
        return HangFinding(
            (), "no stack could be read" + (f": {'; '.join(errors)}" if errors else "")
        )
    return HangFinding(
        (), "no rank waits in a collective: the job may be stuck outside torch.distributed"
    )


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
