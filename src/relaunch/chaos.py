"""Fault plans: faults to inject into a running job, so that users can rehearse failures.

A plan is YAML or JSON::

    faults:
      - {kind: process-exit, at_step: 20, pod: 1, exit_code: 1}
      - {kind: chip-fault, after_s: 5, pod: 0, chip: 0, code: 80E18005, heals: true}
      - {kind: node-down, at_step: 60, pod: 1}
      - {kind: hang, at_step: 80, pod: 0, rank: 1}
      - {kind: network, after_s: 3, node: node-2, duration_s: 30}
      - {kind: memory-uce, at_step: 10, pod: 1, chip: 1}

`at_step` fires when the job reports that step; `after_s` that many seconds after the current
attempt started. Each entry fires once. `pod: i` targets the node pod i is on when it fires.
Pure: parsing and trigger arithmetic only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from relaunch.errors import InputError, Problem
from relaunch.faults import normalize_code
from relaunch.validation import boolean, choice, integer, problems_from, reject, seconds, v

__all__ = ["ChaosEntry", "ChaosKind", "parse_plan"]


class ChaosKind(StrEnum):
    PROCESS_EXIT = "process-exit"
    CHIP_FAULT = "chip-fault"
    NODE_DOWN = "node-down"
    HANG = "hang"
    NETWORK = "network"
    MEMORY_UCE = "memory-uce"


def _code(value: Any) -> str:
    try:
        return normalize_code(value)
    except (ValueError, TypeError):
        raise reject("an 8-hex-digit fault code like 80E18005") from None


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Annotated[ChaosKind, v(choice(ChaosKind))]
    at_step: Annotated[int | None, v(integer(0, None, "steps"))] = None
    after_s: Annotated[float | None, v(seconds(-1e-9))] = None
    pod: Annotated[int | None, v(integer(0, None, "pod index"))] = None
    node: str | None = None
    rank: Annotated[int | None, v(integer(0, None, "global rank"))] = None
    chip: Annotated[int, v(integer(0, 64, "chip index"))] = 0
    exit_code: Annotated[int, v(integer(1, 255, "exit code"))] = 1
    code: Annotated[str | None, v(_code)] = None
    heals: Annotated[bool, v(boolean)] = True
    duration_s: Annotated[float | None, v(seconds(0))] = None


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    faults: list[_Entry] = Field(default_factory=list)


_DEFAULT_CODES = {ChaosKind.CHIP_FAULT: "80E18005", ChaosKind.MEMORY_UCE: "80E01801"}


@dataclass(frozen=True)
class ChaosEntry:
    index: int
    kind: ChaosKind
    at_step: int | None
    after_s: float | None
    pod: int | None
    node: str | None
    rank: int | None
    chip: int
    exit_code: int
    code: str | None
    heals: bool
    duration_s: float | None

    def due(self, step: int | None, attempt_elapsed_s: float) -> bool:
        if self.at_step is not None:
            return step is not None and step >= self.at_step
        return self.after_s is not None and attempt_elapsed_s >= self.after_s

    def describe(self) -> str:
        trigger = (
            f"at step {self.at_step}" if self.at_step is not None else f"after {self.after_s:g} s"
        )
        target = f"pod {self.pod}" if self.pod is not None else f"node {self.node}"
        return f"{self.kind.value} on {target} {trigger}"


def parse_plan(data: Any, *, source: str = "<fault plan>") -> tuple[ChaosEntry, ...]:
    if data is None:
        return ()
    if isinstance(data, list):
        data = {"faults": data}
    if not isinstance(data, dict):
        raise InputError(source, [Problem("(top level)", data, "a mapping with a `faults` list")])
    try:
        parsed = _Plan.model_validate(data)
    except ValidationError as error:
        raise InputError(source, problems_from(error, data, _Plan)) from None
    problems: list[Problem] = []
    entries = []
    for i, e in enumerate(parsed.faults):
        where = f"faults[{i}]"
        if (e.at_step is None) == (e.after_s is None):
            problems.append(
                Problem(f"{where}.at_step", e.at_step, "exactly one of at_step or after_s")
            )
        if (e.pod is None) == (e.node is None):
            problems.append(
                Problem(f"{where}.pod", e.pod, "exactly one of pod or node as the target")
            )
        if e.kind in (ChaosKind.PROCESS_EXIT, ChaosKind.HANG) and e.pod is None:
            problems.append(
                Problem(f"{where}.pod", None, f"{e.kind.value} needs a pod (and optionally a rank)")
            )
        if e.code is not None and e.kind not in _DEFAULT_CODES:
            problems.append(
                Problem(f"{where}.code", e.code, "a code only for chip-fault or memory-uce")
            )
        entries.append(
            ChaosEntry(
                index=i,
                kind=e.kind,
                at_step=e.at_step,
                after_s=e.after_s,
                pod=e.pod,
                node=e.node,
                rank=e.rank,
                chip=e.chip,
                exit_code=e.exit_code,
                code=e.code or _DEFAULT_CODES.get(e.kind),
                heals=e.heals,
                duration_s=e.duration_s,
            )
        )
    if problems:
        raise InputError(source, problems)
    return tuple(entries)
