"""Turning pydantic validation into relaunch's problems: one per key, naming the key, the value
and what is allowed. Shared by every input file parser (job spec, cluster, fault plan)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, BeforeValidator, ValidationError
from pydantic_core import PydanticCustomError

from relaunch.errors import MISSING, Problem

MAX_PODS = 4096
"""The largest job, in pods, a job file or a fault plan may name: the size the simulation
measures every level at (relaunch_bench.simulation, docs/scale.md)."""

__all__ = [
    "MAX_PODS",
    "boolean",
    "choice",
    "integer",
    "lookup",
    "problems_from",
    "raise_",
    "reject",
    "seconds",
    "v",
]


def reject(allowed: str) -> PydanticCustomError:
    return PydanticCustomError("relaunch", "{allowed}", {"allowed": allowed})


def integer(lo: int, hi: int, what: str = "") -> Callable[[Any], int]:
    """A reader of an integer from `lo` to `hi`: every integer relaunch reads is bounded, so that
    no input can carry a number too large for a float, a metric or a timer."""
    allowed = f"an integer from {lo} to {hi}" + (f" ({what})" if what else "")
    allowed += ', given as a number or a string like "8"'

    def read(value: Any) -> int:
        if isinstance(value, bool):
            raise reject(allowed)
        if isinstance(value, int):
            number = value
        elif (
            isinstance(value, str)
            and len(value) <= 32
            and re.fullmatch(r"\s*[-+]?[0-9]+\s*", value)
        ):
            number = int(value)
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        else:
            raise reject(allowed)
        if not lo <= number <= hi:
            raise reject(allowed)
        return number

    return read


def seconds(lo_exclusive: float, hi: float) -> Callable[[Any], float]:
    """A reader of a finite number of seconds above `lo_exclusive`, at most `hi`."""
    allowed = f"a number of seconds > {lo_exclusive:g} and <= {hi:g}"

    def read(value: Any) -> float:
        if isinstance(value, bool) or (isinstance(value, str) and len(value) > 32):
            raise reject(allowed)
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise reject(allowed) from None
        if not (lo_exclusive < number <= hi):  # False for NaN too
            raise reject(allowed)
        return number

    return read


def seconds_or_off(hi: float) -> Callable[[Any], float]:
    """A reader of a setting that 0 turns off: 0, or a number of seconds above 0, at most `hi`."""
    some = seconds(0, hi)
    allowed = f"0 (off) or a number of seconds > 0 and <= {hi:g}"

    def read(value: Any) -> float:
        if not isinstance(value, bool) and isinstance(value, int | float) and value == 0:
            return 0.0
        if isinstance(value, str) and value.strip() in ("0", "0.0"):
            return 0.0
        try:
            return some(value)
        except ValueError:
            raise reject(allowed) from None

    return read


BOOL_ALLOWED = 'true or false (a boolean or the string "true" / "false")'


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise reject(BOOL_ALLOWED)


def choice(enum: type[StrEnum], *, extra: str = "") -> Callable[[Any], StrEnum]:
    names = ", ".join(repr(m.value) for m in enum)
    allowed = f"one of {names}" + (f"; {extra}" if extra else "")

    def read(value: Any) -> StrEnum:
        if isinstance(value, str):
            try:
                return enum(value.strip())
            except ValueError:
                pass
        raise reject(allowed)

    return read


def v(reader: Callable[[Any], Any]) -> BeforeValidator:
    return BeforeValidator(reader)


def raise_(error: Exception) -> Any:
    raise error


def lookup(data: Any, loc: tuple[str | int, ...]) -> Any:
    node = data
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list | tuple) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return MISSING
    return node


def problems_from(
    error: ValidationError,
    data: Any,
    root: type[BaseModel],
    hints: Mapping[tuple[str, ...], str] | None = None,
) -> list[Problem]:
    """One :class:`Problem` per pydantic error; `hints` says what a missing key should hold."""
    problems: list[Problem] = []
    for item in error.errors(include_url=False):
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and "[" in p))
        key = _dotted(loc)
        kind = item["type"]
        if kind == "relaunch":
            allowed = str(item["ctx"]["allowed"])
        elif kind == "missing":
            hint = (hints or {}).get(tuple(map(str, loc)), "this key must be given")
            allowed = "required: " + hint
        elif kind == "extra_forbidden":
            allowed = "unknown key; allowed here: " + ", ".join(_allowed_keys(root, loc[:-1]))
        elif kind.endswith("_type") and kind.startswith("model"):
            allowed = "a mapping"
        elif kind == "list_type":
            allowed = "a list"
        else:
            allowed = str(item["msg"])
        value = MISSING if kind == "missing" else lookup(data, loc)
        problems.append(Problem(key, value, allowed))
    return problems


def _dotted(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _allowed_keys(root: type[BaseModel], parent: tuple[str | int, ...]) -> list[str]:
    """The keys a mapping at `parent` may hold, by alias where a field has one."""
    model = root
    for part in parent:
        if isinstance(part, int):
            continue
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        field = fields.get(str(part))
        nested = _model_in(field.annotation) if field is not None else None
        if nested is None:
            return []
        model = nested
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model type inside `Model`, `list[Model]`, `tuple[Model, ...]` or `Model | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
