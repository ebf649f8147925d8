"""R-29's settings as MindCluster spells them in a job's environment, read by the spec (which
checks them and says what is wrong) and by the training SDK (which finds them in its own
environment): standard library only.

    HCCL_OP_RETRY_ENABLE="L0:0, L1:1, L2:1"     relaunch's pods are the servers: L1 turns it on
    HCCL_OP_RETRY_PARAMS="MaxCnt:3, HoldTime:5000, IntervalTime:1000"
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "OP_RETRY_ENABLE",
    "OP_RETRY_PARAMS",
    "OperatorRetry",
    "from_environment",
    "parse_enable",
    "parse_params",
]

OP_RETRY_ENABLE: Final = "HCCL_OP_RETRY_ENABLE"
OP_RETRY_PARAMS: Final = "HCCL_OP_RETRY_PARAMS"
_LAYERS: Final = ("L0", "L1", "L2")
_PARAMS: Final = {"MaxCnt": (1, 10), "HoldTime": (0, 60000), "IntervalTime": (0, 60000)}


@dataclass(frozen=True)
class OperatorRetry:
    """How many times a failed collective may be issued again, how long after its failure the
    first may come, and how long between two."""

    max_count: int = 1
    hold_s: float = 5.0
    interval_s: float = 1.0

    @property
    def rides_out_s(self) -> float:
        """The longest link outage the re-issues outlast, for a collective that fails as the
        link goes down: the last re-issue goes HoldTime + (MaxCnt - 1) x IntervalTime after
        the failure, and a re-issue due while a link is down is skipped and counts. A longer
        outage spends them, and the ladder goes on (process-retry, R-30)."""
        return self.hold_s + (self.max_count - 1) * self.interval_s


def _pairs(text: str, keys: tuple[str, ...]) -> dict[str, str] | None:
    """`KEY:VALUE, KEY:VALUE` as a dict, each key once and known; None if it is not that."""
    if len(text) > 200:
        return None
    found: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition(":")
        key = key.strip()
        if not sep or key not in keys or key in found:
            return None
        found[key] = value.strip()
    return found


def parse_enable(text: str) -> bool | None:
    """Whether HCCL_OP_RETRY_ENABLE turns retries on between servers (L1); None: malformed."""
    layers = _pairs(text, _LAYERS)
    if layers is None or any(v not in ("0", "1") for v in layers.values()):
        return None
    return layers.get("L1") == "1"


def parse_params(text: str) -> OperatorRetry | None:
    """HCCL_OP_RETRY_PARAMS read (absent keys: MindCluster's defaults); None: malformed."""
    given = _pairs(text, tuple(_PARAMS))
    if given is None:
        return None
    numbers = {}
    for key, value in given.items():
        lo, hi = _PARAMS[key]
        if not re.fullmatch(r"[0-9]{1,6}", value) or not lo <= int(value) <= hi:
            return None
        numbers[key] = int(value)
    return OperatorRetry(
        numbers.get("MaxCnt", 1),
        numbers.get("HoldTime", 5000) / 1000,
        numbers.get("IntervalTime", 1000) / 1000,
    )


def from_environment(env: Mapping[str, str]) -> OperatorRetry | None:
    """The settings an environment asks for (None: off, or malformed: the spec refused that)."""
    if not parse_enable(env.get(OP_RETRY_ENABLE, "L1:0")):
        return None
    params = env.get(OP_RETRY_PARAMS)
    return parse_params(params) if params is not None else OperatorRetry()
