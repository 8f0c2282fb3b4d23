"""Shared pieces of op definitions: dtype checks, axis normalization and registration shorthands."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..attrs import Attr
from ..dtypes import DType
from ..errors import ShapeError
from ..registry import OpDef, register
from ..traits import Trait
from ..types import TensorType

Check = Callable[[str, int, TensorType], None]


def floating(op: str, i: int, t: TensorType) -> None:
    if not t.dtype.is_float:
        raise ShapeError(f"{op}: operand {i} has dtype {t.dtype.value}, expected a floating dtype")


def numeric(op: str, i: int, t: TensorType) -> None:
    if not (t.dtype.is_float or t.dtype.is_int):
        raise ShapeError(f"{op}: operand {i} has dtype {t.dtype.value}, expected a numeric dtype")


def boolean(op: str, i: int, t: TensorType) -> None:
    if t.dtype is not DType.bool:
        raise ShapeError(f"{op}: operand {i} has dtype {t.dtype.value}, expected bool")


def any_dtype(op: str, i: int, t: TensorType) -> None:
    if t.dtype.is_packed:
        raise ShapeError(f"{op}: operand {i} has packed dtype {t.dtype.value}; dequantize it first")


def holds_values(op: str, i: int, t: TensorType) -> None:
    """Refuse nf4, whose codes index a float table (i4/u4/i2/u2 codes are integers: see `DType.holds_values`)."""
    if not t.dtype.holds_values:
        raise ShapeError(f"{op}: operand {i} has packed dtype {t.dtype.value}; dequantize it first")


def same_dtype(op: str, types: Sequence[TensorType]) -> None:
    first = types[0].dtype
    for i, t in enumerate(types[1:], 1):
        if t.dtype is not first:
            raise ShapeError(f"{op}: operand {i} has dtype {t.dtype.value} but operand 0 has {first.value}; "
                             "insert a cast")


def norm_axis(op: str, axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{op}: axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def norm_axes(op: str, axes: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(rank))
    out = tuple(norm_axis(op, a, rank) for a in axes)
    if len(set(out)) != len(out):
        raise ShapeError(f"{op}: repeated axis in {tuple(axes)}")
    return tuple(sorted(out))


def one(fn: Callable[..., np.ndarray]) -> Callable[[Sequence[np.ndarray], Mapping[str, Any]], tuple]:
    """Adapt a single-result `fn(*arrays, **attrs)` to the registry's reference signature."""
    return lambda xs, attrs: (np.asarray(fn(*xs, **attrs)),)


def define(name: str, operands: tuple[str, ...], infer, reference, attrs: Mapping[str, Attr] | None = None,
           doc: str = "", traits: Iterable[Trait] = ()) -> OpDef:
    return register(OpDef(name, operands, attrs or {}, infer, reference, doc, frozenset(traits)))
