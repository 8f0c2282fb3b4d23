"""Lazy initializers (Burn's set, plus Python callables): argument schemas and numpy evaluation.

A parameter's initializer runs only when its value is needed, seeded by its ParamId so the same parameter
always initializes to the same value, whoever asks first. A Python initializer (kind `python`, made by
`python(fn)`) is called as `fn(shape, dtype, rng)` with the same seeded `numpy.random.Generator`; it lives only
in the process that made it, so `.kir` prints it as `init = python` and cannot read it back.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .attrs import BOOL, FLOAT, INT, Attr, optional, validate_attrs
from .errors import ShapeError
from .graph import Init
from .param_id import ParamId
from .types import DType, TensorType


@dataclass(frozen=True)
class InitDef:
    schema: dict[str, Attr]
    sample: Callable[..., np.ndarray]  # (shape, rng, **args) -> float64 array
    domain: Callable[[dict], str | None] = lambda args: None  # what is wrong with valid-typed arguments, if anything


def _ordered(args: dict) -> str | None:
    return f"min {args['min']} is above max {args['max']}" if args["min"] > args["max"] else None


def _spread(args: dict) -> str | None:
    return f"std {args['std']} is negative" if args["std"] < 0 else None


def _fans_positive(args: dict) -> str | None:
    bad = [k for k in ("fan_in", "fan_out") if args.get(k) is not None and args[k] <= 0]
    return f"{bad[0]} {args[bad[0]]} is not positive" if bad else None


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
                       lambda shape, rng, min, max: rng.uniform(min, max, shape), _ordered),
    "normal": InitDef({"mean": Attr(FLOAT, 0.0), "std": Attr(FLOAT, 1.0)},
                      lambda shape, rng, mean, std: rng.normal(mean, std, shape), _spread),
    "kaiming_uniform": InitDef(
        {**_GAIN, **_FANS, "fan_out_only": Attr(BOOL, False)},
        lambda shape, rng, **a: (lambda b: rng.uniform(-b, b, shape))(a["gain"] * math.sqrt(3 / _fan(a, "fan_in"))),
        _fans_positive),
    "kaiming_normal": InitDef(
        {**_GAIN, **_FANS, "fan_out_only": Attr(BOOL, False)},
        lambda shape, rng, **a: rng.normal(0.0, a["gain"] * math.sqrt(1 / _fan(a, "fan_in")), shape), _fans_positive),
    "xavier_uniform": InitDef(
        {**_GAIN, **_FANS},
        lambda shape, rng, **a: (lambda b: rng.uniform(-b, b, shape))(a["gain"] * math.sqrt(6 / _xavier_fans(a))),
        _fans_positive),
    "xavier_normal": InitDef(
        {**_GAIN, **_FANS},
        lambda shape, rng, **a: rng.normal(0.0, a["gain"] * math.sqrt(2 / _xavier_fans(a)), shape), _fans_positive),
}


PYTHON = "python"

PythonInit = Callable[[tuple[int, ...], DType, np.random.Generator], np.ndarray]


def python(fn: PythonInit) -> Init:
    """An initializer calling `fn(shape, dtype, rng)`, `rng` seeded from the parameter's ParamId."""
    if not callable(fn):
        raise ShapeError(f"a Python initializer must be callable as fn(shape, dtype, rng), not {fn!r}")
    return Init(PYTHON, (("fn", fn),))


def identity(init: Init, type: TensorType, seed: int) -> str:
    """What tells initial values apart across processes (compile-cache keys): a built-in's kind and arguments;
    for a Python initializer, whose repr is only an address, a digest of the value it gives."""
    if init.kind != PYTHON:
        return repr(init)
    return hashlib.blake2b(evaluate(init, type, seed).tobytes(), digest_size=20).hexdigest()


def check(init: Init) -> Init:
    """Validate an initializer's kind and arguments; returns it with arguments in schema order."""
    if init.kind == PYTHON:
        return python(init.kwargs.get("fn"))
    if init.kind not in INITIALIZERS:
        raise ShapeError(f"unknown initializer {init.kind!r}")
    spec = INITIALIZERS[init.kind]
    schema = spec.schema
    full = validate_attrs(init.kind, schema, dict(init.args))
    infinite = [k for k, v in full.items() if isinstance(v, float) and not math.isfinite(v)]
    problem = f"{infinite[0]} {full[infinite[0]]} is not finite" if infinite else spec.domain(full)
    if problem:
        raise ShapeError(f"{init.kind}: {problem}")
    return Init(init.kind, tuple((k, v) for k, v in full.items() if v != schema[k].default or k in init.kwargs))


def evaluate(init: Init, type: TensorType, seed: int) -> np.ndarray:
    """The initial value of a parameter of this type; deterministic in `seed` (the ParamId)."""
    if not type.is_static:
        raise ShapeError(f"cannot initialize a parameter of dynamic type {type}")
    size = type.numel() * type.dtype.bits // 8
    too_big = ShapeError(f"parameter {ParamId(seed)} of type {type} needs {size:,} bytes, more than this machine "
                         "can allocate")
    if size >= 2**62:  # beyond what numpy can even describe
        raise too_big
    try:
        return sample(init, type, np.random.default_rng(seed), ParamId(seed))
    except MemoryError:
        raise too_big from None


def sample(init: Init, type: TensorType, rng: np.random.Generator, param: ParamId) -> np.ndarray:
    """The initializer's value for a parameter (`param`, named in errors) of this static type, drawn from `rng`."""
    if init.kind != PYTHON:
        spec = INITIALIZERS[init.kind]
        args = validate_attrs(init.kind, spec.schema, init.kwargs)
        return np.asarray(spec.sample(type.shape, rng, **args)).astype(type.dtype.numpy)
    fn = init.kwargs["fn"]
    return checked(fn(type.shape, type.dtype, rng), type, param, fn, "initializer")


def checked(value: object, type: TensorType, param: ParamId, fn: Callable, role: str) -> np.ndarray:
    """What the Python `fn` (a `role`, named in errors) gave as the value of parameter `param` of this type: the
    same shape and kind of dtype (float, int or bool), cast to the dtype; else a ShapeError naming both."""
    value = np.asarray(value)
    source = f"{role} {getattr(fn, '__qualname__', repr(fn))}"
    if value.shape != type.shape:
        raise ShapeError(f"{source} gave shape {list(value.shape)} for parameter {param} of type {type}")
    if _kind(value.dtype) != type.dtype.kind:
        raise ShapeError(f"{source} gave {value.dtype} values for parameter {param} of type {type}")
    return value.astype(type.dtype.numpy)


def _kind(dtype: np.dtype) -> str:
    """The DType kind of a numpy result; its name when kiln has no such dtype."""
    try:
        return DType.from_numpy(dtype).kind
    except ValueError:
        return str(dtype)
