"""Dataclasses to JSON-ready dicts and back, by their type hints: nested dataclasses, tuples,
dicts with int keys (JSON keys are strings), optionals. Standard library only, so that every
side of the protocol (the SDK included) can use it without importing a validation library."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

__all__ = ["from_data", "to_data"]

T = TypeVar("T")


def to_data(value: Any) -> Any:
    """A dataclass (or a structure of them) as plain JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_data(v) for v in value]
    return value


def from_data(cls: type[T], data: Any) -> T:
    """`data` (as `to_data` wrote it, after a JSON round trip) as a `cls`. Raises ValueError or
    TypeError when it does not fit."""
    return typing.cast(T, _convert(cls, data))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(kind: Any, data: Any) -> Any:
    origin = typing.get_origin(kind)
    if kind is Any:
        return data
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        if not isinstance(data, dict):
            raise TypeError(f"{kind.__name__}: expected a mapping, got {type(data).__name__}")
        hints = _hints(kind)
        known = {f.name for f in dataclasses.fields(kind) if f.init}
        return kind(**{k: _convert(hints[k], v) for k, v in data.items() if k in known})
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if data is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, data)
            except (TypeError, ValueError) as error:
                errors.append(str(error))
        raise TypeError("; ".join(errors) or f"{data!r} fits none of {kind}")
    if origin is tuple:
        args = typing.get_args(kind)
        items = list(data) if isinstance(data, list | tuple) else _raise(kind, data)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], item) for item in items)
        return tuple(_convert(a, item) for a, item in zip(args, items, strict=True))
    if origin is list:
        (arg,) = typing.get_args(kind)
        return [
            _convert(arg, item) for item in (data if isinstance(data, list) else _raise(kind, data))
        ]
    if origin is dict:
        key, value = typing.get_args(kind)
        if not isinstance(data, dict):
            _raise(kind, data)
        return {_convert(key, k): _convert(value, v) for k, v in data.items()}
    if kind is int:
        if isinstance(data, bool) or not isinstance(data, int | str):
            _raise(kind, data)
        return int(data)
    if kind is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            _raise(kind, data)
        return float(data)
    if kind is str:
        return data if isinstance(data, str) else _raise(kind, data)
    if kind is bool:
        return data if isinstance(data, bool) else _raise(kind, data)
    return data


def _raise(kind: Any, data: Any) -> Any:
    raise TypeError(f"expected {kind}, got {type(data).__name__} {data!r:.60}")
