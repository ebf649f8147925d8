"""A node's real NVIDIA GPUs, read through NVML (nvidia-ml-py): Xid events, ECC counts, retired
pages and remapped rows, and a GPU that is lost. The node agent reads its chips here when NVML
and a GPU are present and simulates them otherwise; what the readings mean is pure logic in
relaunch.faults.gpu_codes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final

from relaunch.faults.gpu_codes import GpuReading

__all__ = ["NvmlChips", "open_gpus"]


class NvmlChips:
    """The GPUs `first` .. `first + count - 1` of this machine as a node's chips 0 .. count - 1
    (several simulated nodes of the embedded cluster share one machine's GPUs this way). `nvml`
    is the pynvml module (a stand-in in unit tests)."""

    def __init__(self, nvml: Any, first: int, count: int) -> None:
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(first + i) for i in range(count)]
        self.events: Any = None
        try:
            self.events = nvml.nvmlEventSetCreate()
            for handle in self.handles:
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self.events
                )
        except nvml.NVMLError:  # no events (a vGPU, no permission): the conditions still read
            self.events = None

    @property
    def count(self) -> int:
        return len(self.handles)

    def look(self) -> list[GpuReading]:
        """Every chip read once, with the Xid events since the last look."""
        xids = self._xid_events()
        return [
            self._read(chip, handle, xids.get(chip, ())) for chip, handle in enumerate(self.handles)
        ]

    def _xid_events(self) -> dict[int, tuple[int, ...]]:
        found: dict[int, list[int]] = {}
        if self.events is None:
            return {}
        nvml = self.nvml
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self.events, 0)
            except nvml.NVMLError_Timeout:
                break
            except nvml.NVMLError:
                break  # a lost GPU fails the wait too; its queries say so below
            if event.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            for chip, handle in enumerate(self.handles):
                if _same(nvml, handle, event.device):
                    found.setdefault(chip, []).append(int(event.eventData))
        return {chip: tuple(ids) for chip, ids in found.items()}

    def _read(self, chip: int, handle: Any, xids: tuple[int, ...]) -> GpuReading:
        nvml = self.nvml
        try:
            nvml.nvmlDeviceGetUUID(handle)  # answers GPU_IS_LOST for a GPU off the bus
        except nvml.NVMLError_GpuIsLost:
            return GpuReading(chip, lost=True)
        uncorrected = _optional(
            nvml,
            lambda: int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            ),
        )
        remapped = _optional(nvml, lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        retired = _optional(nvml, lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        return GpuReading(
            chip,
            lost=uncorrected is _LOST or remapped is _LOST or retired is _LOST,
            xids=xids,
            uncorrected_ecc=uncorrected if isinstance(uncorrected, int) else None,
            remap_failure=isinstance(remapped, tuple) and bool(remapped[3]),
            remap_pending=isinstance(remapped, tuple) and bool(remapped[2]),
            retired_pending=retired is not None
            and retired is not _LOST
            and retired == nvml.NVML_FEATURE_ENABLED,
        )


_LOST = object()


def _optional(nvml: Any, query: Callable[[], Any]) -> Any:
    """A query's answer; None where the GPU does not support it; _LOST where the GPU is gone."""
    try:
        return query()
    except nvml.NVMLError_GpuIsLost:
        return _LOST
    except nvml.NVMLError:
        return None


def _same(nvml: Any, one: Any, other: Any) -> bool:
    try:
        return bool(nvml.nvmlDeviceGetIndex(one) == nvml.nvmlDeviceGetIndex(other))
    except nvml.NVMLError:
        return False


SIMULATE_CHIPS_ENV: Final = "RELAUNCH_SIMULATE_CHIPS"
"""`1`: the embedded cluster's chips are simulated even where NVML sees GPUs (`relaunch run
--simulate-chips`): no pod is given a GPU, and no job is refused for the machine's GPUs."""


def gpu_count() -> int | None:
    """How many GPUs NVML sees on this machine; None where it cannot look (no nvidia-ml-py, no
    driver) or where chips are to be simulated (SIMULATE_CHIPS_ENV)."""
    if os.environ.get(SIMULATE_CHIPS_ENV) == "1":
        return None
    try:
        import pynvml  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return None


def chips_problem(total_chips: int, gpus: int | None) -> str | None:
    """Why a cluster of `total_chips` chips cannot run on this machine's `gpus` GPUs (None: it
    can): on the embedded cluster every chip is one of the machine's GPUs, node by node, where
    the machine has GPUs at all. Pure."""
    if not gpus or total_chips <= gpus:
        return None
    return (
        f"the cluster's {total_chips} chips would be GPUs 0-{total_chips - 1} of this machine, "
        f"which has {gpus}: give the cluster fewer nodes or chips (--nodes, --chips-per-node, "
        "or its file), or run on simulated chips with --simulate-chips (its pods then share "
        "the GPUs)"
    )


def simulate_args(total_chips: int) -> tuple[str, ...]:
    """`relaunch run`'s `--simulate-chips` where this machine has GPUs, but fewer than a
    cluster's chips (its pods then share them, as before pods owned their GPUs): for the tests
    and the bench, whose clusters are sized for any machine."""
    gpus = gpu_count()
    return ("--simulate-chips",) if chips_problem(total_chips, gpus) is not None else ()


def open_gpus(first: int, count: int) -> tuple[NvmlChips | None, str]:
    """This machine's GPUs `first` .. `first + count - 1` through NVML, or None and why not (no
    nvidia-ml-py, no driver, fewer GPUs than that, or SIMULATE_CHIPS_ENV): the agent then
    simulates its chips."""
    if os.environ.get(SIMULATE_CHIPS_ENV) == "1":
        return None, "simulated (--simulate-chips)"
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
        present = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as error:
        return None, f"NVML: {error}"
    if present < first + count:
        return (
            None,
            f"NVML shows {present} GPU(s); chips {first}..{first + count - 1} are not there",
        )
    return NvmlChips(pynvml, first, count), f"NVML: GPUs {first}..{first + count - 1} of {present}"
