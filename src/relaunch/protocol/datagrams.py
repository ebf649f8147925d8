"""The training SDK's datagrams to its pod's launcher: "RANK STEP AT" (progress: the step, and
when the script reported it, which can be well before the datagram goes: a report held back by
the interval waits for the next) or "RANK @PHASE" (what the rank is doing, for R-37). Kept apart from the wire messages and free of dataclasses:
every training process imports it, and its start is on the path of every recovery."""

from __future__ import annotations

from typing import Final

__all__ = ["SdkPhase", "parse_datagram", "phase_datagram", "progress_datagram"]


class SdkPhase:
    """What the training SDK says a rank is doing, for R-37."""

    TRAINING: Final = "training"
    CHECKPOINT: Final = "checkpoint"
    """Saving a checkpoint."""
    GROUP: Final = "group"
    """Building (or rebuilding) its communication group."""


def progress_datagram(rank: int, step: int, at: float | None = None) -> bytes:
    return (f"{rank} {int(step)}" + (f" {at:.6f}" if at is not None else "")).encode()


def phase_datagram(rank: int, phase: str) -> bytes:
    return f"{rank} @{phase}".encode()


def parse_datagram(data: bytes) -> tuple[int, int | str, float | None] | None:
    """(rank, step, when it was reported) or (rank, phase, None); None for anything else."""
    try:
        rank_text, value, *rest = data.decode().split()
        rank = int(rank_text)
        if value.startswith("@"):
            return rank, value[1:], None
        return rank, int(value), float(rest[0]) if rest else None
    except (ValueError, UnicodeDecodeError):
        return None
