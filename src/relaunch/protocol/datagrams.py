"""The training SDK's datagrams to its pod's launcher: "RANK STEP AT" (progress: the step, and
when the script reported it, which can be well before the datagram goes: a report held back by
the interval waits for the next), "RANK @PHASE" (what the rank is doing, for R-37) or
"RANK !STEP COLLECTIVE GENERATION WHY" (a collective failed on its transport, R-29) or
"RANK #STEP TIER HOLDER" (the rank restored a checkpoint's step, the tier its bytes came from and
the node or rank that held them) or "RANK %STEP CLEAN CULPRITS SEEN" (the replicas' parameters
apart at STEP, R-45: the last step they agreed, the ranks that differ, each fingerprint seen). Kept apart from the wire messages and free of dataclasses:
every training process imports it, and its start is on the path of every recovery."""

from __future__ import annotations

from enum import StrEnum
from typing import Final, NamedTuple

__all__ = [
    "CollectiveFailure",
    "CorruptionReport",
    "Restore",
    "RestoreTier",
    "SdkPhase",
    "collective_failure_datagram",
    "corruption_datagram",
    "parse_datagram",
    "phase_datagram",
    "progress_datagram",
    "restored_datagram",
]

DATAGRAM_MAX: Final = 256
"""The longest datagram the launcher reads."""


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


class CollectiveFailure(NamedTuple):
    step: int
    collective: int
    generation: int
    why: str


def collective_failure_datagram(
    rank: int, step: int, collective: int, generation: int, why: str
) -> bytes:
    head = f"{rank} !{step} {collective} {generation} ".encode()
    return head + why.encode("utf-8", "replace")[: DATAGRAM_MAX - len(head)]


class RestoreTier(StrEnum):
    """Where a restore's bytes came from; `holder` names the node (or the rank) that held them."""

    PEER_MEMORY = "peer-memory"
    LOCAL_DISK = "local-disk"
    STORAGE = "storage"
    REPLICA = "replica"
    """A healthy replica's memory (an online retry's, or process-level recovery's)."""

    @property
    def words(self) -> str:
        """The tier as a person says it."""
        return {
            RestoreTier.PEER_MEMORY: "peer memory",
            RestoreTier.LOCAL_DISK: "local disk",
            RestoreTier.STORAGE: "storage",
            RestoreTier.REPLICA: "a healthy replica",
        }[self]

    def source(self, holder: str = "") -> str:
        """Where the bytes came from, in words: "peer memory of node-2", "storage"."""
        if self is RestoreTier.STORAGE or not holder:
            return self.words
        if self is RestoreTier.REPLICA:
            return f"the memory of rank {holder}, a healthy replica"
        return f"{self.words} of {holder}"


class CorruptionReport(NamedTuple):
    """A rank found the replicas' fingerprints apart at `step` (R-45)."""

    step: int
    clean_step: int | None
    """The last step every replica agreed at (None: no check agreed yet)."""
    culprits: tuple[int, ...]
    fingerprints: tuple[str, ...]
    """Each distinct fingerprint and how many ranks had it: "3f2a…:2"."""


def corruption_datagram(
    rank: int, step: int, clean_step: int | None, culprits: tuple[int, ...], seen: tuple[str, ...]
) -> bytes:
    clean = "-" if clean_step is None else str(clean_step)
    named = ",".join(map(str, culprits)) or "-"
    text = f"{rank} %{step} {clean} {named} {','.join(seen) or '-'}"
    return text.encode()[:DATAGRAM_MAX]


def _corruption(value: str, rest: list[str]) -> CorruptionReport:
    clean, named, seen = rest[0], rest[1], rest[2]
    culprits = () if named == "-" else tuple(int(r) for r in named.split(","))
    fingerprints = () if seen == "-" else tuple(seen.split(","))
    return CorruptionReport(
        int(value), None if clean == "-" else int(clean), culprits, fingerprints
    )


class Restore(NamedTuple):
    step: int
    tier: str
    """Which tier served the bytes (a `relaunch.restores.RestoreTier`'s value)."""
    holder: str
    """The node (or rank) that held them; "" for storage."""


def restored_datagram(rank: int, step: int, tier: str, holder: str) -> bytes:
    head = f"{rank} #{step} {tier} ".encode()
    return head + holder.encode("utf-8", "replace")[: DATAGRAM_MAX - len(head)]


def parse_datagram(
    data: bytes,
) -> tuple[int, int | str | CollectiveFailure | Restore | CorruptionReport, float | None] | None:
    """(rank, step, when it was reported), (rank, phase, None), (rank, a collective's failure,
    None), (rank, a restore, None) or (rank, a corruption found, None); None for anything
    else."""
    try:
        text = data.decode(errors="replace")
        rank_text, value, *rest = text.split(maxsplit=4)
        rank = int(rank_text)
        if value.startswith("#"):
            tier, *holder = text.split(maxsplit=3)[2:]
            tier = RestoreTier(tier).value  # an unknown tier is no restore
            return rank, Restore(int(value[1:]), tier, holder[0] if holder else ""), None
        if value.startswith("@"):
            return rank, value[1:], None
        if value.startswith("%"):
            return rank, _corruption(value[1:], rest), None
        if value.startswith("!"):
            collective, generation = int(rest[0]), int(rest[1])
            why = rest[2] if len(rest) > 2 else ""
            return rank, CollectiveFailure(int(value[1:]), collective, generation, why), None
        return rank, int(value), float(rest[0]) if rest else None
    except (ValueError, IndexError):
        return None
