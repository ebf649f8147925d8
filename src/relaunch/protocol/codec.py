"""Dataclasses to JSON-ready dicts and back, by their type hints: nested dataclasses, tuples,
dicts with int keys (JSON keys are strings), optionals. Standard library only, so that every
side of the protocol (the SDK included) can use it without importing a validation library."""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, Final, TypeVar

__all__ = ["from_data", "to_data"]

T = TypeVar("T")


def to_data(value: Any) -> Any:
    """A dataclass (or a structure of them) as plain JSON-ready values: dataclasses as dicts,
    tuples as lists, dict keys as strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encoder(type(value))(value)
    return _any(value)


def _any(value: Any) -> Any:
    """to_data for a value whose type is known only now."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encoder(type(value))(value)
    if isinstance(value, dict):
        return {str(k): _any(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_any(v) for v in value]
    return value


PLAIN: Final = (int, float, str, bool, type(None))
"""Types JSON takes as they are (a str or int enum member is one of them)."""


@functools.cache
def _encoder(kind: type) -> Callable[[Any], dict[str, Any]]:
    """to_data for a dataclass, built once per type from its hints: launchers and agents encode
    a message or two every second, and walking every value to find out its type cost more than
    the JSON. A field of a type the hints cannot settle (Any, a union of structures) is walked."""
    hints = typing.get_type_hints(kind)
    fields = [(f.name, _hinted(hints[f.name])) for f in dataclasses.fields(kind)]
    plain = tuple(name for name, encode in fields if encode is None)
    other = tuple((name, encode) for name, encode in fields if encode is not None)
    order = tuple(name for name, _ in fields)

    def encode(value: Any) -> dict[str, Any]:
        data = {name: getattr(value, name) for name in plain}
        for name, convert in other:
            data[name] = convert(getattr(value, name))
        return {name: data[name] for name in order} if other and plain else data

    return encode


def _hinted(kind: Any) -> Callable[[Any], Any] | None:
    """How a value declared as `kind` becomes JSON-ready; None: it already is."""
    origin = typing.get_origin(kind)
    if kind in PLAIN or (isinstance(kind, type) and issubclass(kind, PLAIN)):
        return None
    if origin is typing.Literal:
        return None
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        return _encoder(kind)
    args = typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            inner = _hinted(options[0])
            if inner is None:
                return None
            return lambda value: None if value is None else inner(value)
        return _any
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            parts = [_hinted(a) for a in args]
            if all(part is None for part in parts):
                return list
            return _any
        each = _hinted(args[0]) if args else _any
        if each is None:
            return list
        return lambda value: [each(item) for item in value]
    if origin is dict and args:
        values = _hinted(args[1])
        if values is None and args[0] is str:
            return None  # JSON-ready as it is (a start's environment, for each of many pods)
        if values is None:
            return lambda value: {str(k): v for k, v in value.items()}
        return lambda value: {str(k): values(v) for k, v in value.items()}
    return _any


def from_data(cls: type[T], data: Any) -> T:
    """`data` (as `to_data` wrote it, after a JSON round trip) as a `cls`. Raises ValueError or
    TypeError when it does not fit."""
    return typing.cast(T, _converter(typing.cast(Any, cls))(data))


@functools.cache
def _converter(kind: Any) -> Callable[[Any], Any]:
    """The function that converts data to `kind`, built once per type from its hints: the
    controller decodes hundreds of messages a second, and reading the hints each time cost more
    than the JSON parsing."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return _same
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        return _dataclass_converter(kind)
    if origin in (typing.Union, types.UnionType):
        return _union_converter(kind)
    if origin is tuple:
        args = typing.get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:
            each = _converter(args[0])
            return lambda data: tuple(map(each, _items(kind, data, (list, tuple))))
        return _fixed_tuple_converter(kind, args)
    if origin is list:
        (arg,) = typing.get_args(kind)
        each = _converter(arg)
        return lambda data: list(map(each, _items(kind, data, (list,))))
    if origin is dict:
        key_type, value_type = typing.get_args(kind)
        keys, values = _converter(key_type), _converter(value_type)

        def mapping(data: Any) -> dict[Any, Any]:
            if not isinstance(data, dict):
                _raise(kind, data)
            return {keys(k): values(v) for k, v in data.items()}

        if key_type is not int:
            return mapping

        def int_keyed(data: Any) -> dict[Any, Any]:
            # JSON's keys are strings: int() each in one pass at C speed (a stop of thousands
            # of pods is tens of thousands of them); anything else goes the careful way
            if type(data) is dict and all(map(str.__instancecheck__, data)):
                try:
                    numbers = list(map(int, data))
                except ValueError as error:
                    raise TypeError(f"expected {kind}: {error}") from None
                return dict(zip(numbers, map(values, data.values()), strict=True))
            return mapping(data)

        return int_keyed
    if kind is int:
        return _int
    if kind is float:
        return _float
    if kind is str:
        return lambda data: data if isinstance(data, str) else _raise(kind, data)
    if kind is bool:
        return lambda data: data if isinstance(data, bool) else _raise(kind, data)
    return _same


def _dataclass_converter(kind: type) -> Callable[[Any], Any]:
    """A mapping to a `kind`: each field's value as its hint says. A value that already is the
    plain type its hint names (an int for an int, None for an optional) is taken as it is
    without a call: the controller decodes tens of thousands of messages in a large job's
    restart, and the calls were most of their cost."""
    hints = typing.get_type_hints(kind)
    fields: dict[str, tuple[tuple[type, ...], Callable[[Any], Any]]] = {}
    for f in dataclasses.fields(kind):
        if f.init:
            hint = hints[f.name]
            fields[f.name] = (_taken_as_is(hint), _converter(hint))
    names = tuple(fields)
    kinds = tuple(as_is for as_is, _ in fields.values())
    plain = all(kinds)  # every field can be taken as it is (a stack's frame: str, str, int)

    def convert(data: Any) -> Any:
        if not isinstance(data, dict):
            raise TypeError(f"{kind.__name__}: expected a mapping, got {type(data).__name__}")
        if (
            plain
            and len(data) == len(names)
            and all(map(operator.contains, kinds, map(type, map(data.get, names))))
        ):
            return kind(**data)  # every field there and as it is: no Python-level call a field
        values = {}
        for name, value in data.items():
            field = fields.get(name)
            if field is not None:
                values[name] = value if type(value) in field[0] else field[1](value)
        return kind(**values)

    return convert


def _fixed_tuple_converter(kind: Any, args: tuple[Any, ...]) -> Callable[[Any], Any]:
    """A list to a tuple of the hinted types, one for each place; an item that already is the
    plain type its place names is taken without a call (a stop of thousands of pods is tens of
    thousands of (attempt, code, signal) tuples)."""
    places = tuple((_taken_as_is(a), _converter(a)) for a in args)
    kinds = tuple(as_is for as_is, _ in places)

    def convert(data: Any) -> Any:
        if (
            type(data) is list
            and len(data) == len(kinds)
            and all(map(operator.contains, kinds, map(type, data)))
        ):
            return tuple(data)  # every item as it is (no Python-level call for each)
        items = _items(kind, data, (list, tuple))
        if len(items) != len(places):
            raise ValueError(f"expected {len(places)} items for {kind}, got {len(items)}")
        return tuple(
            item if type(item) in as_is else part(item)
            for (as_is, part), item in zip(places, items)  # noqa: B905 (lengths checked above)
        )

    return convert


def _taken_as_is(hint: Any) -> tuple[type, ...]:
    """The exact types of value that a field of `hint` takes unconverted (bool is not an int
    here: `type(True) is bool`)."""
    if hint in (int, float, str, bool):
        return (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if all(o in (int, float, str, bool, type(None)) for o in options):
            return tuple(options)
    return ()


def _union_converter(kind: Any) -> Callable[[Any], Any]:
    options = typing.get_args(kind)
    optional = type(None) in options
    choices = [_converter(o) for o in options if o is not type(None)]

    def convert(data: Any) -> Any:
        if data is None and optional:
            return None
        errors = []
        for choice in choices:
            try:
                return choice(data)
            except (TypeError, ValueError) as error:
                errors.append(str(error))
        raise TypeError("; ".join(errors) or f"{data!r} fits none of {kind}")

    return convert


def _items(kind: Any, data: Any, allowed: tuple[type, ...]) -> Any:
    return data if isinstance(data, allowed) else _raise(kind, data)


def _same(data: Any) -> Any:
    return data


def _int(data: Any) -> int:
    if type(data) is int:  # the common case first: the controller decodes thousands a second
        return data
    if isinstance(data, bool) or not isinstance(data, int | str):
        _raise(int, data)
    return int(data)


def _float(data: Any) -> float:
    if type(data) is float:
        return data
    if isinstance(data, bool) or not isinstance(data, int | float):
        _raise(float, data)
    return float(data)


def _raise(kind: Any, data: Any) -> Any:
    raise TypeError(f"expected {kind}, got {type(data).__name__} {data!r:.60}")
