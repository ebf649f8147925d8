"""NVIDIA GPU faults as fault codes: each Xid class and each NVML health condition mapped onto a
MindCluster handling level, as the NPU codes are (R-09), so that a GPU climbs the same ladder and
a fault table file overrides any row. Pure: the readings come from relaunch.cluster.nvml.

Levels and why (NVIDIA's Xid catalog and its "GPU memory error management" guide say what each
event means and what it asks for; docs/gpus.md has the table):

- The application's own error (Xid 13, 31, 43: an illegal address, an exception in a kernel,
  a stopped channel): RestartRequest, user-induced (R-11): restarting the ranks is the fix, and
  it does not count against the hardware.
- The GPU is sound but the work on it is lost (Xid 94 contained ECC, 32, 69): RestartBusiness.
- Memory to fix at the next GPU reset (Xid 63 row remap / page retirement recorded, remap or
  retirement pending): FreeRestartNPU, reset when free.
- The GPU needs a reset now (Xid 48 double-bit ECC, 95 uncontained ECC, 74 NVLink, 61/62/38
  firmware, 119/120 GSP, an uncorrected ECC count that grew): RestartNPU.
- The GPU is gone or its memory cannot be repaired (Xid 79 fallen off the bus, 64 / remap
  failure, NVML's GPU_IS_LOST): SeparateNPU, isolate it.
- Wear without an error yet (Xid 92 high single-bit ECC rate): SubHealthFault.
- Consequences of another fault (Xid 45, channels torn down after a process ended):
  NotHandleFault, recorded only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from relaunch.faults.codes import FaultCode, HandlingLevel

__all__ = ["GPU_ROWS", "PERSISTENT", "GpuReading", "gpu_fault_codes", "most_serious"]

L = HandlingLevel

_XIDS: tuple[tuple[int, HandlingLevel, bool, str], ...] = (
    (13, L.RESTART_REQUEST, True, "graphics engine exception: the application's kernel faulted"),
    (31, L.RESTART_REQUEST, True, "GPU memory page fault: the application read an illegal address"),
    (43, L.RESTART_REQUEST, True, "GPU stopped processing: the application's channel faulted"),
    (45, L.NOT_HANDLE_FAULT, False, "preemptive cleanup after another fault or a killed process"),
    (32, L.RESTART_BUSINESS, False, "invalid or corrupted push buffer stream"),
    (69, L.RESTART_BUSINESS, False, "graphics engine class error"),
    (94, L.RESTART_BUSINESS, False, "contained ECC error: only the work that hit it is lost"),
    (92, L.SUB_HEALTH_FAULT, False, "high single-bit ECC error rate: worn memory"),
    (63, L.FREE_RESTART_NPU, False, "row remapping / page retirement recorded: reset when free"),
    (48, L.RESTART_NPU, False, "double-bit ECC error: reset the GPU"),
    (95, L.RESTART_NPU, False, "uncontained ECC error: every process on the GPU, reset it"),
    (74, L.RESTART_NPU, False, "NVLink error: reset the GPU, check the link"),
    (38, L.RESTART_NPU, False, "driver firmware error"),
    (61, L.RESTART_NPU, False, "internal micro-controller breakpoint / warning"),
    (62, L.RESTART_NPU, False, "internal micro-controller halt"),
    (119, L.RESTART_NPU, False, "GSP RPC timeout"),
    (120, L.RESTART_NPU, False, "GSP error"),
    (64, L.SEPARATE_NPU, False, "row remapping / page retirement failed: memory cannot be fixed"),
    (79, L.SEPARATE_NPU, False, "GPU has fallen off the bus"),
)

_CONDITIONS: tuple[tuple[str, HandlingLevel, str], ...] = (
    ("GPU-LOST", L.SEPARATE_NPU, "NVML answers GPU_IS_LOST: the GPU is gone"),
    ("GPU-ROW-REMAP-FAILURE", L.SEPARATE_NPU, "a row could not be remapped: RMA the GPU"),
    ("GPU-ECC-DBE", L.RESTART_NPU, "the volatile uncorrected ECC count grew: reset the GPU"),
    ("GPU-ROW-REMAP-PENDING", L.FREE_RESTART_NPU, "a row remap waits for the next GPU reset"),
    ("GPU-RETIRED-PAGES-PENDING", L.FREE_RESTART_NPU, "a page retirement waits for the next reset"),
)

GPU_ROWS: tuple[FaultCode, ...] = tuple(
    FaultCode(f"XID-{xid}", level, level.default_severity, user, f"Xid {xid}: {text}")
    for xid, level, user, text in _XIDS
) + tuple(
    FaultCode(code, level, level.default_severity, False, text) for code, level, text in _CONDITIONS
)
"""The default GPU rows, part of the shipped table (relaunch.faults.default_codes)."""


@dataclass(frozen=True)
class GpuReading:
    """What NVML says of one GPU at one look. `lost`: its queries answer GPU_IS_LOST.
    `xids`: the Xid events since the last look. Counts are None where the GPU does not
    support the query (NVML_ERROR_NOT_SUPPORTED), which is no fault."""

    index: int
    lost: bool = False
    xids: tuple[int, ...] = ()
    uncorrected_ecc: int | None = None
    """Volatile uncorrected (double-bit) ECC errors since the driver loaded."""
    remap_failure: bool = False
    remap_pending: bool = False
    retired_pending: bool = False


def gpu_fault_codes(previous: GpuReading | None, now: GpuReading) -> Sequence[str]:
    """The fault codes a look at a GPU shows, given the look before (None: the first): each Xid
    event, the conditions that hold, and a grown uncorrected ECC count when no Xid 48 / 94 / 95
    already said so. A lost GPU is only lost: nothing else can be read of it."""
    if now.lost:
        return ("GPU-LOST",)
    codes = [f"XID-{xid}" for xid in dict.fromkeys(now.xids)]
    ecc_said = any(xid in (48, 94, 95) for xid in now.xids)
    grew = (
        previous is not None
        and previous.uncorrected_ecc is not None
        and now.uncorrected_ecc is not None
        and now.uncorrected_ecc > previous.uncorrected_ecc
    )
    if grew and not ecc_said:
        codes.append("GPU-ECC-DBE")
    if now.remap_failure:
        codes.append("GPU-ROW-REMAP-FAILURE")
    elif now.remap_pending:
        codes.append("GPU-ROW-REMAP-PENDING")
    if now.retired_pending:
        codes.append("GPU-RETIRED-PAGES-PENDING")
    return tuple(codes)


PERSISTENT: frozenset[str] = frozenset(
    {"GPU-LOST", "GPU-ROW-REMAP-FAILURE", "GPU-ROW-REMAP-PENDING", "GPU-RETIRED-PAGES-PENDING"}
)
"""Conditions that hold until the GPU is reset or replaced: reported once, while they hold, and
not healed by an in-place recovery (which cannot reset a GPU). Xids and a grown ECC count are
events: each is reported when it happens and heals."""

_LEVEL_OF = {row.code: row.level for row in GPU_ROWS}


def most_serious(codes: Sequence[str]) -> str | None:
    """The code of a look to report for its chip (a chip reports one fault at a time): the most
    serious by the default table, an unknown Xid counting as SeparateNPU (R-09)."""
    if not codes:
        return None
    return max(codes, key=lambda c: _LEVEL_OF.get(c, HandlingLevel.SEPARATE_NPU))
