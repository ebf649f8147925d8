"""The fault codes relaunch knows out of the box (R-09, R-11).

The codes named in docs/recovery-rules.md (and the source documents it cites), plus a selection of Ascend NPU codes with the handling
level MindCluster's device plugin assigns them in its public default table, plus the NVIDIA GPU
codes of relaunch.faults.gpu_codes (Xids and NVML conditions). Descriptions are
ours. Users extend or override this table with `--fault-table FILE`.
"""

from __future__ import annotations

from relaunch.faults.codes import FaultCode, FaultCodeTable, HandlingLevel
from relaunch.faults.gpu_codes import GPU_ROWS

__all__ = ["DEFAULT_TABLE", "default_rows"]

L = HandlingLevel

_NAMED: tuple[tuple[str, HandlingLevel, bool, str], ...] = (
    (
        "80E01801",
        L.RESTART_BUSINESS,
        False,
        "HBM multi-bit ECC: uncorrectable on-chip memory error",
    ),
    ("80E18005", L.RESTART_NPU, False, "chip error cleared by a chip reset"),
    ("81078603", L.NOT_HANDLE_FAULT, False, "network port link down"),
    ("80C98002", L.RESTART_REQUEST, True, "AI Core operator execution error caused by its input"),
    ("80CB8002", L.RESTART_REQUEST, True, "AI Vector operator execution error caused by its input"),
)

# Further codes by level, from MindCluster's default table (a selection, not all of it).
_BY_LEVEL: dict[HandlingLevel, tuple[str, ...]] = {
    L.NOT_HANDLE_FAULT: ("80E21007", "80E38003", "80F78006", "80C98006", "80CB8006", "80A18006"),
    L.SUB_HEALTH_FAULT: ("81A3880C", "81AD8605", "80E20207", "81078605", "80DE0207"),
    L.RESTART_REQUEST: ("80C98008", "80C98003", "80C98009", "80CB8008", "80CB8009", "80CF8003"),
    L.RESTART_BUSINESS: ("8C204E00", "A8028802", "A4302003", "B4060011", "81B38009", "A2301001"),
    L.FREE_RESTART_NPU: ("8C0E4E00", "8C104E00", "8C0C4E00", "8C044E00", "8C064E00"),
    L.RESTART_NPU: ("8C03A000", "8C1FA006", "40F84E00", "80E24E00", "80E21E01", "80E38008"),
    L.SEPARATE_NPU: ("80E3A201", "80E18402", "80E0020B", "817F8002", "A2301000", "A2301001"),
}


def default_rows() -> tuple[FaultCode, ...]:
    rows = [
        FaultCode(code, level, level.default_severity, user, text)
        for code, level, user, text in _NAMED
    ]
    for level, codes in _BY_LEVEL.items():
        rows.extend(FaultCode(code, level, level.default_severity) for code in codes)
    return (*rows, *GPU_ROWS)


DEFAULT_TABLE = FaultCodeTable(default_rows())
"""A2301001 is listed at two levels, as in MindCluster's table; it resolves to SeparateNPU."""
