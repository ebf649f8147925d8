"""The exceptions relaunch raises, each with a message a user can act on.

Every error a user can cause derives from :class:`RelaunchError`. Input errors carry one
:class:`Problem` per offending key, so that a file with three mistakes reports all three at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FaultPlanError",
    "FaultTableError",
    "InputError",
    "Problem",
    "RelaunchError",
    "SpecError",
    "StoreError",
    "StoreFull",
]


class RelaunchError(Exception):
    """Base class of every error relaunch reports to a user."""


@dataclass(frozen=True)
class Problem:
    """One invalid input: where it is, what was given, and what is allowed instead."""

    key: str
    value: Any
    allowed: str
    found: str | None = None
    """Says what is wrong in words, where showing the value would not (a syntax error)."""

    def __str__(self) -> str:
        if self.found is not None:
            return f"{self.key}: {self.found}; expected {self.allowed}"
        if self.value is _MISSING:
            return f"{self.key}: missing; {self.allowed}"
        return f"{self.key}: {_show(self.value)} is not allowed; {self.allowed}"


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()
MISSING: Any = _MISSING
"""Sentinel for :attr:`Problem.value` when the key is absent."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class InputError(RelaunchError):
    """A file or request the user wrote is invalid; :attr:`problems` lists every mistake."""

    what = "input"

    def __init__(self, source: str, problems: Iterable[Problem]) -> None:
        self.source = source
        self.problems: tuple[Problem, ...] = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        count = len(self.problems)
        noun = "problem" if count == 1 else "problems"
        super().__init__(f"{source}: invalid {self.what}, {count} {noun}:\n{lines}")


class SpecError(InputError):
    """A job spec is invalid."""

    what = "job spec"


class FaultTableError(InputError):
    """A fault code table file is invalid."""

    what = "fault table"


class FaultPlanError(InputError):
    """A fault plan is invalid, or names a pod, rank, chip or node the job and cluster lack."""

    what = "fault plan"


class StoreFull(RelaunchError):
    """The disk holding the state directory is full: nothing is wrong with the database, and the
    job's record is intact up to the last write that fit."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(
            f"the disk holding {path} is full ({detail}): relaunch cannot record the job. Its "
            "pods keep running for the adopt grace; free space, then `relaunch run --resume` "
            "carries the job on"
        )


class StateDirBusy(RelaunchError):
    """Another `relaunch run` or runner holds the state directory's lock."""


class NoRoom(RelaunchError):
    """The cluster has no room for a job's pods on its Ready nodes."""


class EngineError(RelaunchError):
    """The engine cannot be used: a Ray cluster that cannot be reached or has no live node, a
    trial cluster that did not start, a network namespace without root."""


class StoreError(RelaunchError):
    """The state directory's database cannot be used (not a database, damaged, unreadable)."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(
            f"{path}: {detail}; this is not a usable relaunch state database (move it away, "
            "or pass another --state-dir)"
        )
