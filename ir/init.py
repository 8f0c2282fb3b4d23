"""Lazy initializers (Burn's set): argument schemas and numpy evaluation.

A parameter's initializer runs only when its value is needed, seeded by its ParamId so the same parameter
always initializes to the same value, whoever asks first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .attrs import BOOL, FLOAT, INT, Attr, optional, validate_attrs
from .errors import ShapeError
from .graph import Init
from .types import TensorType


@dataclass(frozen=True)
class InitDef:
    schema: dict[str, Attr]
    sample: Callable[..., np.ndarray]  # (shape, rng, **args) -> float64 array


def _fan(args: dict, key: str) -> float:
    fan = args["fan_out"] if args.get("fan_out_only") else args[key]
    if fan is None or fan <= 0:
        raise ShapeError(f"initializer needs a positive {key if not args.get('fan_out_only') else 'fan_out'}")
    return float(fan)


def _xavier_fans(args: dict) -> float:
    if args["fan_in"] is None or args["fan_out"] is None:
        raise ShapeError("xavier initializers need fan_in and fan_out")
    return float(args["fan_in"] + args["fan_out"])


_FANS = {"fan_in": Attr(optional(INT), None), "fan_out": Attr(optional(INT), None)}
_GAIN = {"gain": Attr(FLOAT, 1.0)}

INITIALIZERS: dict[str, InitDef] = {
    "zeros": InitDef({}, lambda shape, rng: np.zeros(shape)),
    "ones": InitDef({}, lambda shape, rng: np.ones(shape)),
    "constant": InitDef({"value": Attr(FLOAT)}, lambda shape, rng, value: np.full(shape, value)),
    "uniform": InitDef({"min": Attr(FLOAT), "max": Attr(FLOAT)},
                       lambda shape, rng, min, max: rng.uniform(min, max, shape)),
    "normal": InitDef({"mean": Attr(FLOAT, 0.0), "std": Attr(FLOAT, 1.0)},
                      lambda shape, rng, mean, std: rng.normal(mean, std, shape)),
    "kaiming_uniform": InitDef(
        {**_GAIN, **_FANS, "fan_out_only": Attr(BOOL, False)},
        lambda shape, rng, **a: (lambda b: rng.uniform(-b, b, shape))(a["gain"] * math.sqrt(3 / _fan(a, "fan_in")))),
    "kaiming_normal": InitDef(
        {**_GAIN, **_FANS, "fan_out_only": Attr(BOOL, False)},
        lambda shape, rng, **a: rng.normal(0.0, a["gain"] * math.sqrt(1 / _fan(a, "fan_in")), shape)),
    "xavier_uniform": InitDef(
        {**_GAIN, **_FANS},
        lambda shape, rng, **a: (lambda b: rng.uniform(-b, b, shape))(a["gain"] * math.sqrt(6 / _xavier_fans(a)))),
    "xavier_normal": InitDef(
        {**_GAIN, **_FANS},
        lambda shape, rng, **a: rng.normal(0.0, a["gain"] * math.sqrt(2 / _xavier_fans(a)), shape)),
}


def check(init: Init) -> Init:
    """Validate an initializer's kind and arguments; returns it with arguments in schema order."""
    if init.kind not in INITIALIZERS:
        raise ShapeError(f"unknown initializer {init.kind!r}")
    schema = INITIALIZERS[init.kind].schema
    full = validate_attrs(init.kind, schema, dict(init.args))
    return Init(init.kind, tuple((k, v) for k, v in full.items() if v != schema[k].default or k in init.kwargs))


def evaluate(init: Init, type: TensorType, seed: int) -> np.ndarray:
    """The initial value of a parameter of this type; deterministic in `seed` (the ParamId)."""
    if not type.is_static:
        raise ShapeError(f"cannot initialize a parameter of dynamic type {type}")
    spec = INITIALIZERS[init.kind]
    args = validate_attrs(init.kind, spec.schema, init.kwargs)
    rng = np.random.default_rng(seed)
    return np.asarray(spec.sample(type.shape, rng, **args)).astype(type.dtype.numpy)
