"""Attribute kinds: validation of op attributes against a schema, and a hashable key for attributes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import DType
from .errors import ShapeError

REQUIRED = object()


@dataclass(frozen=True)
class Attr:
    """One attribute in an op schema: a normalizing checker, a default, and a description for errors."""

    check: Callable[[Any], Any]
    default: Any = REQUIRED
    doc: str = ""


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise TypeError("expected an integer")
    return int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
        raise TypeError("expected a number")
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool | np.bool_):
        raise TypeError("expected true or false")
    return bool(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError("expected a string")
    return v


def _dtype(v: Any) -> DType:
    if isinstance(v, DType):
        return v
    if isinstance(v, str) and v in DType.__members__:
        return DType[v]
    raise TypeError("expected a dtype")


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list | tuple):
        raise TypeError("expected a list of integers")
    return tuple(_int(x) for x in v)


def _dense(v: Any) -> np.ndarray:
    if not isinstance(v, np.ndarray):
        raise TypeError("expected dense<...> data")
    return v


def number(least: float | None = None, most: float | None = None) -> Callable[[Any], float]:
    """A finite number within [least, most] (either bound may be open): for the scales, slopes, epsilons and
    momenta whose NaN or infinity would make every result NaN without an error."""
    def check(v: Any) -> float:
        x = _float(v)
        if not math.isfinite(x):
            raise TypeError("expected a finite number")
        if (least is not None and x < least) or (most is not None and x > most):
            low = "" if least is None else f"{least:g} <= "
            high = "" if most is None else f" <= {most:g}"
            raise TypeError(f"expected {low}value{high}")
        return x
    return check


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An attribute that may be absent (None)."""
    return lambda v: None if v is None else check(v)


def one_of(*choices: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in choices:
            raise TypeError(f"expected one of {', '.join(map(repr, choices))}")
        return v
    return check


INT, FLOAT, BOOL, STR, DTYPE, INTS, DENSE = _int, _float, _bool, _str, _dtype, _ints, _dense
FINITE, EPS = number(), number(least=0.0)


def validate_attrs(op: str, schema: Mapping[str, Attr], attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Check attrs against the schema, fill defaults, and return them in schema order."""
    if not attrs.keys() <= schema.keys():  # a subset test of the key views: no sets built for a valid op
        unknown = sorted(set(attrs) - set(schema))
        raise ShapeError(f"{op}: unknown attribute {unknown[0]!r} (expected {sorted(schema) or 'none'})")
    out: dict[str, Any] = {}
    for name, spec in schema.items():
        if name not in attrs:
            if spec.default is REQUIRED:
                raise ShapeError(f"{op}: missing attribute {name!r}")
            out[name] = spec.default
            continue
        try:
            out[name] = spec.check(attrs[name])
        except TypeError as e:
            raise ShapeError(f"{op}: attribute {name!r} = {attrs[name]!r}: {e}") from None
    return out


def attr_key(value: Any) -> Any:
    """A hashable, name-free key for an attribute value (dense data by dtype, shape and bytes)."""
    if isinstance(value, np.ndarray):
        return ("dense", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, tuple | list):
        return tuple(attr_key(v) for v in value)
    if isinstance(value, float) and math.isnan(value):
        return ("nan",)
    if isinstance(value, bool):
        return ("bool", value)
    return value


def attrs_key(attrs: Mapping[str, Any]) -> tuple:
    return tuple((k, attr_key(v)) for k, v in attrs.items())
