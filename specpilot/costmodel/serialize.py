"""JSON round trip for the cost model's frozen dataclasses, driven by their type hints.

Covers what the records use: nested dataclasses, str enums, tuples (homogeneous `tuple[X, ...]`), optional
values and the JSON scalars. Non-finite floats are refused so attribution.json is strict JSON.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from enum import Enum
from typing import Any


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} cannot be written as strict JSON")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot serialise {type(value).__name__}: {value!r}")


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type `tp` from what to_jsonable wrote."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if data is None:
            return None
        if len(options) != 1:
            raise TypeError(f"cannot decode the union {tp}")
        return from_jsonable(options[0], data)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], item) for item in data)
        if len(args) != len(data):
            raise ValueError(f"expected {len(args)} items for {tp}, got {len(data)}")
        return tuple(from_jsonable(a, item) for a, item in zip(args, data))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{tp.__name__}: unknown field(s) {sorted(unknown)}")
        return tp(**{name: from_jsonable(hints[name], data[name]) for name in names})
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(data)
    if tp is float:
        return float(data)
    if tp in (int, str, bool):
        if not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
            raise TypeError(f"expected {tp.__name__}, got {data!r}")
        return data
    raise TypeError(f"cannot decode type {tp}")
