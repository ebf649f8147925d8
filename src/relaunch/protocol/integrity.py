"""Silent data corruption, as the fault plan, the launcher and the training SDK share it: what a
rehearsed corruption strikes, and the request a launcher leaves for the rank it strikes (the SDK
carries it out inside the rank, where a bad chip would). Pure: no I/O, no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

__all__ = ["CORRUPTION_SUFFIX", "Corruption", "CorruptionTarget"]

CORRUPTION_SUFFIX: Final = ".corrupt"
"""The request's file: `$RELAUNCH_INJECT_DIR/<pid>.corrupt`, for the process `pid`."""


class CorruptionTarget(StrEnum):
    """What a rehearsed corruption changes in a rank's memory: one bit of a parameter, or of the
    optimizer's state for one (SGD's momentum, Adam's moments)."""

    PARAMETER = "parameter"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class Corruption:
    """A request to flip one bit of the rank's `target` (its first tensor's first element), once
    or, `repeat`, after every step from then on (a chip that computes wrong)."""

    target: CorruptionTarget = CorruptionTarget.PARAMETER
    repeat: bool = False

    def to_json(self) -> str:
        return json.dumps({"target": self.target.value, "repeat": self.repeat})

    @classmethod
    def from_json(cls, text: str) -> Corruption:
        """The request in `text`; ValueError for one that is not."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("repeat", False), bool):
            raise ValueError(f"not a corruption request: {text[:80]!r}")
        return cls(CorruptionTarget(data.get("target", "parameter")), data.get("repeat", False))
