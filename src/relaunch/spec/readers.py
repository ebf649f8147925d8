"""Scalar readers for the job file: the API sends every annotation as a string, so "8" and "true"
are accepted. Each raises a PydanticCustomError whose message is the "what is allowed" half of a
Problem. Pure."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final

from relaunch.protocol.operator import OperatorRetry, parse_enable, parse_params
from relaunch.spec.vocabulary import RecoverStrategy
from relaunch.validation import reject

__all__ = [
    "MAX_TEXT",
    "OperatorRetry",
    "command",
    "env",
    "job_name",
    "long_text",
    "on_off",
    "op_retry_enable",
    "op_retry_params",
    "path",
    "short_text",
    "strategies",
    "text_ok",
]


def on_off(value: Any) -> bool:
    if isinstance(value, str) and value.strip() in ("on", "off"):
        return value.strip() == "on"
    raise reject("'on' or 'off' (MindCluster spelling; 'true' is not accepted)")


def strategies(value: Any) -> tuple[RecoverStrategy, ...]:
    names = ", ".join(m.value for m in RecoverStrategy)
    allowed = f"a comma-separated list of: {names}"
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
    elif isinstance(value, list | tuple):
        items = [str(item).strip() for item in value]
    else:
        raise reject(allowed)
    if not items:
        raise reject(allowed + " (at least one)")
    unknown = [item for item in items if item not in {m.value for m in RecoverStrategy}]
    if unknown:
        raise reject(f"unknown strategy {', '.join(map(repr, unknown))}; {allowed}")
    chosen = {RecoverStrategy(item) for item in items}
    return tuple(sorted(chosen, key=lambda s: s.priority))


MAX_TEXT: Final = 65536
"""The longest string any spec value may be (a command, an env value, an annotation)."""


def text_ok(value: str) -> bool:
    """A string a process can be given: no NUL byte (no C string holds one), not too long."""
    return "\0" not in value and len(value) <= MAX_TEXT


def command(value: Any) -> tuple[str, ...]:
    allowed = "a non-empty shell command string or a non-empty list of strings, without NUL bytes"
    if isinstance(value, str) and value.strip() and text_ok(value):
        return ("/bin/sh", "-c", value)
    if (
        isinstance(value, list | tuple)
        and value
        and len(value) <= 4096
        and all(isinstance(a, str | int) and not isinstance(a, bool) for a in value)
        and all(text_ok(str(a)) for a in value)
    ):
        return tuple(str(a) for a in value)
    raise reject(allowed)


def path(value: Any) -> str:
    if isinstance(value, str) and value.strip() and "\0" not in value and len(value) <= 4096:
        return value
    raise reject("a directory path (a non-empty string without NUL bytes)")


def absolute_path(value: Any) -> str:
    if (
        isinstance(value, str)
        and value.startswith("/")
        and "\0" not in value
        and len(value) <= 4096
    ):
        return value
    raise reject("an absolute directory path on each node's own disk (it starts with /)")


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env(value: Any) -> dict[str, str]:
    allowed = "a mapping of environment variable names to string, number or boolean values"
    if not isinstance(value, Mapping):
        raise reject(allowed)
    env: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or len(name) > 256 or not ENV_NAME.fullmatch(name):
            raise reject(f"{allowed}; {name!r} is not a valid variable name")
        if isinstance(item, bool):
            text = "true" if item else "false"
        elif isinstance(item, str | int) or (isinstance(item, float) and math.isfinite(item)):
            text = str(item)
        else:
            raise reject(f"{allowed}; the value of {name} is a {type(item).__name__}")
        if not text_ok(text):
            raise reject(f"{allowed}; the value of {name} holds a NUL byte or is too long")
        env[name] = text
    return env


JOB_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def short_text(value: Any) -> str:
    if isinstance(value, str) and len(value) <= 253 and "\0" not in value:
        return value
    raise reject("a string of at most 253 characters")


def long_text(value: Any) -> str:
    if isinstance(value, str) and text_ok(value):
        return value
    raise reject(f"a string of at most {MAX_TEXT} characters, without NUL bytes")


def job_name(value: Any) -> str:
    if isinstance(value, str) and JOB_NAME.fullmatch(value):
        return value
    raise reject(
        "a name of lowercase letters, digits and '-', starting and ending with a letter or "
        "digit, at most 63 characters"
    )


def op_retry_enable(value: Any) -> bool:
    """HCCL_OP_RETRY_ENABLE: whether operator retry is on between servers (L1)."""
    on = parse_enable(value) if isinstance(value, str) else None
    if on is None:
        raise reject(
            "layers and 0 or 1, like 'L0:0, L1:1, L2:1' (L1, between servers, turns it on)"
        )
    return on


def op_retry_params(value: Any) -> OperatorRetry:
    """HCCL_OP_RETRY_PARAMS: re-issues allowed, the hold before the first, the interval."""
    params = parse_params(value) if isinstance(value, str) else None
    if params is None:
        raise reject(
            "'MaxCnt:N, HoldTime:MS, IntervalTime:MS' (each optional): MaxCnt 1 to 10 re-issues, "
            "HoldTime and IntervalTime 0 to 60000 milliseconds"
        )
    return params
