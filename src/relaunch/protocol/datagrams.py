"""The training SDK's datagrams to its pod's launcher: "RANK STEP" (progress) or "RANK @PHASE"
(what the rank is doing, for R-37). Kept apart from the wire messages and free of dataclasses:
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


def progress_datagram(rank: int, step: int) -> bytes:
    return f"{rank} {int(step)}".encode()


def phase_datagram(rank: int, phase: str) -> bytes:
    return f"{rank} @{phase}".encode()


def parse_datagram(data: bytes) -> tuple[int, int | str] | None:
    """(rank, step) or (rank, phase); None for anything else."""
    try:
        rank_text, value = data.decode().split()[:2]
        rank = int(rank_text)
        if value.startswith("@"):
            return rank, value[1:]
        return rank, int(value)
    except (ValueError, UnicodeDecodeError):
        return None
