"""Tensor types: a shape of static (int) or dynamic (None, printed `?`) dims, optional names of dynamic dims
(printed `?{batch}`: two dims of one name are one size at run time), and a DType."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .dtypes import DType
from .errors import ShapeError

Dim = int | None
Axis = int | str | None  # a dim seen with its name: an int, the name of a named dynamic dim, or an anonymous `?`
DIM_NAME = re.compile(r"[^{}<>,\s]+")


@dataclass(frozen=True, slots=True)
class TensorType:
    """The type of an SSA value, parameter or flag."""

    shape: tuple[Dim, ...]
    dtype: DType
    names: tuple[str | None, ...] = ()  # per dim, the name of a named dynamic dim; () when no dim has one

    def __post_init__(self) -> None:
        for d in self.shape:
            if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
                raise ShapeError(f"invalid dimension {d!r} in shape {self.shape}")
        if not any(self.names):
            object.__setattr__(self, "names", ())
            return
        if len(self.names) != len(self.shape):
            raise ShapeError(f"dim names {self.names} do not match shape {self.shape}")
        for d, n in zip(self.shape, self.names):
            if n is not None and (d is not None or not isinstance(n, str) or not DIM_NAME.fullmatch(n)):
                raise ShapeError(f"invalid dim name {n!r} for dim {'?' if d is None else d} (a name is given "
                                 "to dynamic dims only, without spaces, commas, braces or angle brackets)")

    @staticmethod
    def of(axes: Iterable[Axis], dtype: DType) -> TensorType:
        """The type whose `axes` these are."""
        axes = tuple(axes)
        if str not in map(type, axes):  # no named dim: the axes are the shape (checked in __post_init__)
            return TensorType(axes, dtype)
        return TensorType(tuple(None if isinstance(a, str) else a for a in axes), dtype,
                          tuple(a if isinstance(a, str) else None for a in axes))

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The dims with a named dynamic dim given as its name."""
        if not self.names:
            return self.shape
        return tuple(n if n is not None else d for d, n in zip(self.shape, self.names))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return None not in self.shape

    def numel(self) -> int:
        """Element count of a static type."""
        if not self.is_static:
            raise ShapeError(f"{self} has dynamic dims and no element count")
        n = 1
        for d in self.shape:
            n *= d  # type: ignore[operator]
        return n

    def with_shape(self, shape: Iterable[Dim]) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def with_axes(self, axes: Iterable[Axis]) -> TensorType:
        return TensorType.of(axes, self.dtype)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(self.shape, dtype, self.names)

    def matches(self, shape: Sequence[int]) -> bool:
        """Whether a concrete shape is an instance of this (possibly dynamic) type."""
        if len(shape) != len(self.shape):
            return False
        for d, s in zip(self.shape, shape):  # a plain loop: the interpreter checks every result of every op
            if d is not None and d != s:
                return False
        return True

    def __str__(self) -> str:
        dims = "".join(_axis_text(a) + "x" for a in self.axes)
        return f"tensor<{dims}{self.dtype.value}>"


def _axis_text(a: Axis) -> str:
    return "?" if a is None else f"?{{{a}}}" if isinstance(a, str) else str(a)


def broadcast_shapes(*shapes: tuple[Axis, ...], what: str = "operands") -> tuple[Dim, ...]:
    """Numpy broadcasting over static and dynamic dims; a `?` against n>1 is taken to be n."""
    return tuple(None if isinstance(a, str) else a for a in broadcast_axes(*shapes, what=what))


def broadcast_axes(*shapes: tuple[Axis, ...], what: str = "operands") -> tuple[Axis, ...]:
    """Numpy broadcasting of dims with their names: an n > 1 wins over every dynamic dim (which must be n or 1);
    among dynamic dims, one name (against itself, 1 or anonymous `?`s, which must be it or 1) is kept, and two
    different names give an anonymous `?` (either may be 1)."""
    if shapes and all(s == shapes[0] for s in shapes):  # equal shapes broadcast to themselves: the common case
        return tuple(shapes[0])
    rank = max((len(s) for s in shapes), default=0)
    out: list[Axis] = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        known = {d for d in dims if isinstance(d, int) and d != 1}
        names = {d for d in dims if isinstance(d, str)}
        if len(known) > 1:
            raise ShapeError(f"{what}: shapes {' and '.join(_fmt(s) for s in shapes)} do not broadcast")
        if known:
            out.append(known.pop())
        elif len(names) == 1:
            out.append(names.pop())
        elif names or None in dims:
            out.append(None)
        else:
            out.append(1)
    return tuple(out)


def _fmt(shape: tuple[Axis, ...]) -> str:
    return "[" + ", ".join(_axis_text(d) for d in shape) + "]"


def check_named_dims(types: Sequence[TensorType], shapes: Sequence[Sequence[int]], labels: Sequence[str]) -> None:
    """Inputs that share a dim name must agree on its size: a ShapeError naming both places otherwise."""
    seen: dict[str, tuple[int, str]] = {}
    for t, shape, label in zip(types, shapes, labels):
        for axis, name in enumerate(t.names):
            if name is None or axis >= len(shape) or shape[axis] is None:  # a traced input's size is unknown
                continue
            size, where = seen.setdefault(name, (shape[axis], f"{label} dim {axis}"))
            if size != shape[axis]:
                raise ShapeError(f"dim ?{{{name}}} is {size} in {where} but {shape[axis]} in {label} dim {axis}")
