"""Fault kinds (R-08) and the fault record every detector produces."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Final

__all__ = ["ErrorReport", "Fault", "FaultKind", "Severity"]


class FaultKind(StrEnum):
    """What was observed. Detectors emit these; classification decides what they mean."""

    PROCESS_EXIT = "process-exit"  # a rank exited non-zero or by a signal
    CHIP = "chip"  # an accelerator reported a fault code
    NODE_LOST = "node-lost"  # a node's agent stopped answering (heartbeat timeout)
    HANG = "hang"  # no progress for the hang window (suspension)
    NETWORK = "network"  # a link went down, for duration_s seconds
    MEMORY_UCE = "memory-uce"  # on-chip memory uncorrectable error
    SLOW = "slow"
    """A pod persistently slower than its peers (MindCluster's SubHealthFault): the job runs
    at its pace."""
    COLLECTIVE = "collective"
    """A collective the training SDK issued failed on its transport (its link went down, or it
    outlived its timeout): R-29's trigger, reported by the rank, with the step and the place of
    the collective in it."""
    SILENT_CORRUPTION = "silent-corruption"
    """The replicas' parameters are no longer bit-identical (R-45): a chip computed wrong
    without failing; the rank the majority names is the culprit (`rank`, `node`), or none
    where no majority names one."""
    CONTROLLER_OUTAGE = "controller-outage"
    """relaunch's own controller was away longer than the adopt grace, so the pods ended
    themselves: not the job's fault, and not the user's to pay for."""


class Severity(IntEnum):
    """ModelArts fault severities. Warning: record only; Minor and Major: self-healable;
    Critical: not self-healable (R-09)."""

    WARNING = 0
    MINOR = 1
    MAJOR = 2
    CRITICAL = 3

    @property
    def self_healable(self) -> bool:
        return self in (Severity.MINOR, Severity.MAJOR)

    @classmethod
    def parse(cls, text: str) -> Severity:
        return cls[text.strip().upper()]


@dataclass(frozen=True)
class ErrorReport:
    """What a failed rank said about its failure: the exception (type, message, traceback) from
    its torchelastic error file, or from the last lines of its output. `at`: when it was
    written or printed (the launcher's clock), which may be long before the process exited."""

    type: str
    message: str
    traceback: str
    at: float
    source: str
    """"error-file" (TORCHELASTIC_ERROR_FILE) or "output" (the rank's last lines)."""

    def summary(self) -> str:
        return f"{self.type}: {self.message}" if self.type else self.message

    def environment_cause(self) -> str | None:
        """What of the machine the error names, where it names something no restart of the
        user's code changes (a full disk, a spent quota); None: nothing."""
        text = f"{self.type} {self.message}"
        for marks, cause in _ENVIRONMENT_ERRORS:
            if any(mark in text for mark in marks):
                return cause
        return None


_ENVIRONMENT_ERRORS: Final = (
    (("[Errno 28]", "No space left on device"), "the disk is full"),
    (("[Errno 122]", "Disk quota exceeded"), "the disk quota is spent"),
)
"""errno's ENOSPC and EDQUOT as Python prints them (OSError: [Errno 28] No space left on ...)."""


@dataclass(frozen=True)
class Fault:
    """One observed fault. `at` is seconds on the controller's clock, given, never read here.

    The record checks itself: each kind carries the fields that locate it.
    """

    kind: FaultKind
    at: float
    node: str | None = None
    chip: int | None = None
    pod: int | None = None
    rank: int | None = None
    code: str | None = None
    reported_severity: Severity | None = None
    exit_code: int | None = None
    signal: int | None = None
    duration_s: float | None = None
    detail: str = ""
    error: ErrorReport | None = None
    """A failed rank's own account of its failure, where it left one."""
    step: int | None = None
    """A collective fault: the step it failed in..."""
    collective: int | None = None
    """... and its place in that step (0: the step's first collective)."""

    def __post_init__(self) -> None:
        needs: dict[FaultKind, tuple[str, ...]] = {
            FaultKind.CHIP: ("node", "chip", "code"),
            FaultKind.NODE_LOST: ("node",),
            FaultKind.NETWORK: ("node",),
            FaultKind.MEMORY_UCE: ("node",),
            FaultKind.SLOW: ("node", "pod"),
            FaultKind.COLLECTIVE: ("rank", "step", "collective"),
            FaultKind.SILENT_CORRUPTION: ("step",),
        }
        missing = [name for name in needs.get(self.kind, ()) if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.kind.value} fault needs {', '.join(missing)}")
        if self.kind is FaultKind.PROCESS_EXIT:
            if self.exit_code is None and self.signal is None:
                raise ValueError("a process-exit fault needs exit_code or signal")
            if self.exit_code == 0 and self.signal is None:
                raise ValueError("exit code 0 is a success, not a fault")
        if self.code is not None:
            object.__setattr__(self, "code", normalize_code(self.code))

    @property
    def chip_key(self) -> tuple[str, int] | None:
        if self.node is None or self.chip is None:
            return None
        return (self.node, self.chip)

    def describe(self) -> str:
        """One line a person reads: kind and where."""
        parts = [self.kind.value]
        if self.code:
            parts.append(self.code)
        where = [f"node {self.node}"] if self.node else []
        if self.chip is not None:
            where.append(f"chip {self.chip}")
        if self.pod is not None:
            where.append(f"pod {self.pod}")
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.exit_code is not None:
            where.append(f"exit code {self.exit_code}")
        if self.signal is not None:
            where.append(f"signal {self.signal}")
        if self.duration_s is not None:
            where.append(f"{self.duration_s:g} s")
        if self.collective is not None:
            where.append(f"collective {self.collective} of step {self.step}")
        elif self.step is not None:
            where.append(f"found at step {self.step}")
        return " ".join(parts) + (f" ({', '.join(where)})" if where else "")


GPU_CONDITIONS: Final = (
    "GPU-LOST",
    "GPU-ECC-DBE",
    "GPU-ROW-REMAP-FAILURE",
    "GPU-ROW-REMAP-PENDING",
    "GPU-RETIRED-PAGES-PENDING",
)
"""The NVIDIA GPU conditions NVML shows without an Xid event (relaunch.faults.gpu_codes)."""

_XID = re.compile(r"^XID[-_ ]?0*(\d{1,4})$")


def normalize_code(code: str | int) -> str:
    """A fault code: 8 hex digits for an Ascend NPU code (YAML reads an all-digit code as an
    int); `XID-<n>` for an NVIDIA Xid (`xid79`, `Xid 79` are the same); or a GPU condition of
    :data:`GPU_CONDITIONS`."""
    text = f"{code:08d}" if isinstance(code, int) else str(code).strip()
    upper = text.upper()
    xid = _XID.match(upper)
    if xid is not None and 0 < int(xid.group(1)) < 1000:
        return f"XID-{int(xid.group(1))}"
    if upper in GPU_CONDITIONS:
        return upper
    if len(text) != 8 or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise ValueError(
            f"fault code {code!r} is not 8 hexadecimal digits (an NPU code like 80E18005), "
            f"XID-<1..999> (an NVIDIA Xid) or one of {', '.join(GPU_CONDITIONS)}"
        )
    return upper
