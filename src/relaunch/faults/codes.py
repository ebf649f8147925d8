"""The fault code table: what each chip fault code means and how seriously to take it (R-09, R-11).

Codes map to MindCluster handling levels, in its order of seriousness, and to ModelArts
severities. The shipped defaults are in :mod:`relaunch.faults.default_codes`; users override them
with a file read by :func:`parse_fault_table` (YAML or JSON, either relaunch's `codes:` list or
MindCluster's `faultCode.json` shape).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

from relaunch.errors import MISSING, FaultTableError, Problem
from relaunch.faults.escalation import EscalationRules
from relaunch.faults.kinds import Severity, normalize_code

__all__ = ["FaultCode", "FaultCodeTable", "FaultTableFile", "HandlingLevel", "parse_fault_table"]


class HandlingLevel(IntEnum):
    """MindCluster handling levels, least serious first (R-09)."""

    NOT_HANDLE_FAULT = 0
    SUB_HEALTH_FAULT = 1
    RESTART_REQUEST = 2
    RESTART_BUSINESS = 3
    FREE_RESTART_NPU = 4
    RESTART_NPU = 5
    PRE_SEPARATE_NPU = 6
    SEPARATE_NPU = 7
    MANUALLY_SEPARATE_NPU = 8

    @property
    def mindcluster_name(self) -> str:
        return _NAMES[self]

    @classmethod
    def parse(cls, text: str) -> HandlingLevel:
        """Accepts MindCluster's spelling (`RestartNPU`) and ours (`restart-npu`, `RESTART_NPU`)."""
        key = text.strip().replace("-", "").replace("_", "").lower()
        for level, name in _NAMES.items():
            if name.lower() == key or name.lower() == key + "fault":
                return level
        raise ValueError(text)

    @property
    def default_severity(self) -> Severity:
        """The ModelArts severity a level implies when the table gives none."""
        if self <= HandlingLevel.SUB_HEALTH_FAULT:
            return Severity.WARNING
        if self <= HandlingLevel.RESTART_BUSINESS:
            return Severity.MINOR
        if self <= HandlingLevel.RESTART_NPU:
            return Severity.MAJOR
        return Severity.CRITICAL


_NAMES: dict[HandlingLevel, str] = {
    HandlingLevel.NOT_HANDLE_FAULT: "NotHandleFault",
    HandlingLevel.SUB_HEALTH_FAULT: "SubHealthFault",
    HandlingLevel.RESTART_REQUEST: "RestartRequest",
    HandlingLevel.RESTART_BUSINESS: "RestartBusiness",
    HandlingLevel.FREE_RESTART_NPU: "FreeRestartNPU",
    HandlingLevel.RESTART_NPU: "RestartNPU",
    HandlingLevel.PRE_SEPARATE_NPU: "PreSeparateNPU",
    HandlingLevel.SEPARATE_NPU: "SeparateNPU",
    HandlingLevel.MANUALLY_SEPARATE_NPU: "ManuallySeparateNPU",
}


@dataclass(frozen=True)
class FaultCode:
    """One row of the table."""

    code: str
    level: HandlingLevel
    severity: Severity
    user_induced: bool = False
    description: str = ""
    known: bool = True
    """False for a row synthesized for a code the table does not list."""

    def more_serious(self, other: FaultCode) -> FaultCode:
        """Merge two rows for the same code: the more serious level and severity win (R-09),
        and a code marked user-induced anywhere stays user-induced (R-11)."""
        return replace(
            self,
            level=max(self.level, other.level),
            severity=max(self.severity, other.severity),
            user_induced=self.user_induced or other.user_induced,
            description=self.description or other.description,
        )


class FaultCodeTable:
    """Code -> :class:`FaultCode`. Rows given twice merge to the more serious level."""

    def __init__(self, rows: Iterable[FaultCode] = ()) -> None:
        self._rows: dict[str, FaultCode] = {}
        for row in rows:
            earlier = self._rows.get(row.code)
            self._rows[row.code] = row if earlier is None else earlier.more_serious(row)

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[FaultCode]:
        return iter(sorted(self._rows.values(), key=lambda r: (-r.level, r.code)))

    def __contains__(self, code: object) -> bool:
        return isinstance(code, str) and normalize_code(code) in self._rows

    def lookup(self, code: str, reported: Severity | None = None) -> FaultCode:
        """The row for `code`. An unknown code reported as Warning or Minor is handled as
        NotHandleFault; any other unknown code as SeparateNPU (R-09)."""
        key = normalize_code(code)
        row = self._rows.get(key)
        if row is not None:
            return row
        if reported is not None and reported <= Severity.MINOR:
            level = HandlingLevel.NOT_HANDLE_FAULT
        else:
            level = HandlingLevel.SEPARATE_NPU
        return FaultCode(
            key, level, level.default_severity, description="unknown code", known=False
        )

    def overridden_by(self, rows: Iterable[FaultCode]) -> FaultCodeTable:
        """A new table where each given row replaces the row for its code.

        Overrides replace rather than merge, so that a user can lower a level the defaults set.
        """
        merged = FaultCodeTable(rows)
        table = FaultCodeTable()
        table._rows = {**self._rows, **merged._rows}
        return table


@dataclass(frozen=True)
class FaultTableFile:
    """What an override file holds: rows and, optionally, escalation settings."""

    rows: tuple[FaultCode, ...]
    escalation: EscalationRules | None


_LEVEL_LIST_SUFFIX = "Codes"
_ROW_KEYS = ("code", "level", "severity", "user_induced", "description")
_ESCALATION_KEYS = {
    "window_seconds": ("window_s", 60, 864000, "seconds"),
    "threshold": ("threshold", 1, 100, "faults"),
    "release_after_seconds": ("release_after_s", 1, 10 * 365 * 86400, "seconds"),
    "network_blip_seconds": ("network_blip_s", 0, 3600, "seconds"),
}
_LEVEL_NAMES = ", ".join(_NAMES.values())
_SEVERITY_NAMES = ", ".join(s.name.capitalize() for s in Severity)


def parse_fault_table(data: Any, *, source: str = "<fault table>") -> FaultTableFile:
    """Read an override file's content. Raises :class:`FaultTableError` listing every problem."""
    if not isinstance(data, Mapping):
        raise FaultTableError(source, [Problem("(top level)", data, "a mapping")])
    rows: list[FaultCode] = []
    problems: list[Problem] = []
    user_induced: set[str] = set()
    escalation: EscalationRules | None = None
    for key, value in data.items():
        if key == "codes":
            rows.extend(_rows_from_list(value, problems))
        elif key == "user_induced":
            user_induced |= set(_code_list("user_induced", value, problems))
        elif key == "escalation":
            escalation = _escalation(value, problems)
        elif isinstance(key, str) and key.endswith(_LEVEL_LIST_SUFFIX):
            try:
                level = HandlingLevel.parse(key[: -len(_LEVEL_LIST_SUFFIX)])
            except ValueError:
                problems.append(
                    Problem(key, value, f"unknown level list; levels are {_LEVEL_NAMES}")
                )
                continue
            for code in _code_list(key, value, problems):
                rows.append(FaultCode(code, level, level.default_severity))
        else:
            problems.append(
                Problem(
                    str(key),
                    value,
                    "unknown key; allowed: codes, user_induced, escalation, or a MindCluster "
                    "level list such as RestartNPUCodes",
                )
            )
    if problems:
        raise FaultTableError(source, problems)
    rows = [replace(r, user_induced=True) if r.code in user_induced else r for r in rows]
    listed = {r.code for r in rows}
    for code in sorted(user_induced - listed):
        rows.append(FaultCode(code, HandlingLevel.RESTART_REQUEST, Severity.MINOR, True))
    return FaultTableFile(tuple(rows), escalation)


def _code_list(key: str, value: Any, problems: list[Problem]) -> list[str]:
    if not isinstance(value, list):
        problems.append(Problem(key, value, "a list of 8-hex-digit fault codes"))
        return []
    codes = []
    for i, item in enumerate(value):
        try:
            codes.append(normalize_code(item))
        except (ValueError, TypeError):
            problems.append(Problem(f"{key}[{i}]", item, "an 8-hex-digit fault code like 80E18005"))
    return codes


def _rows_from_list(value: Any, problems: list[Problem]) -> list[FaultCode]:
    if not isinstance(value, list):
        problems.append(Problem("codes", value, "a list of {code, level, severity?, ...} rows"))
        return []
    rows = []
    for i, item in enumerate(value):
        where = f"codes[{i}]"
        if not isinstance(item, Mapping):
            problems.append(Problem(where, item, "a mapping with code and level"))
            continue
        for extra in set(item) - set(_ROW_KEYS):
            problems.append(
                Problem(
                    f"{where}.{extra}", item[extra], "unknown key; allowed: " + ", ".join(_ROW_KEYS)
                )
            )
        row = _row(where, item, problems)
        if row is not None:
            rows.append(row)
    return rows


def _row(where: str, item: Mapping[str, Any], problems: list[Problem]) -> FaultCode | None:
    before = len(problems)
    code = ""
    try:
        code = normalize_code(item.get("code", MISSING))
    except (ValueError, TypeError):
        problems.append(
            Problem(f"{where}.code", item.get("code", MISSING), "an 8-hex-digit fault code")
        )
    level = HandlingLevel.NOT_HANDLE_FAULT
    try:
        level = HandlingLevel.parse(str(item["level"]))
    except (KeyError, ValueError):
        problems.append(
            Problem(f"{where}.level", item.get("level", MISSING), f"one of {_LEVEL_NAMES}")
        )
    severity = level.default_severity
    if "severity" in item:
        try:
            severity = Severity.parse(str(item["severity"]))
        except KeyError:
            problems.append(
                Problem(f"{where}.severity", item["severity"], f"one of {_SEVERITY_NAMES}")
            )
    user_induced = item.get("user_induced", False)
    if not isinstance(user_induced, bool):
        problems.append(Problem(f"{where}.user_induced", user_induced, "true or false"))
    if len(problems) > before:
        return None
    return FaultCode(code, level, severity, bool(user_induced), str(item.get("description", "")))


def _escalation(value: Any, problems: list[Problem]) -> EscalationRules | None:
    if not isinstance(value, Mapping):
        problems.append(Problem("escalation", value, "a mapping of " + ", ".join(_ESCALATION_KEYS)))
        return None
    settings: dict[str, Any] = {}
    for key, item in value.items():
        spec = _ESCALATION_KEYS.get(key)
        if spec is None:
            problems.append(
                Problem(
                    f"escalation.{key}",
                    item,
                    "unknown key; allowed: " + ", ".join(_ESCALATION_KEYS),
                )
            )
            continue
        field, lo, hi, unit = spec
        if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
            problems.append(
                Problem(f"escalation.{key}", item, f"an integer from {lo} to {hi} ({unit})")
            )
            continue
        settings[field] = item
    return EscalationRules(**settings)
