"""Converters of ONNX's data-movement and shape ops: Shape, Size, Gather(Elements), Concat, Split, Slice, Reshape,
Flatten, Transpose, Squeeze/Unsqueeze, Expand, ConstantOfShape, Range.

Shapes of tensors with `?` dims travel as `ShapeVector`s (see `symbolic`); `reshape_to` is the one place a target
with run-time dims becomes a kiln `reshape` (dims of one value copied from it at run time, one more inferred as -1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kiln.ir import DType, Value

from .call import NodeCall, Output
from .registry import Unsupported, converts
from .symbolic import Computed, DimOf, Item, ShapeVector


def reshape_to(call: NodeCall, x: Value, dims: Sequence[Item]) -> Value:
    """`x` reshaped to `dims` (ints, -1, run-time dims): the run-time dims of one value (the one most of them come
    from) are copied from it at run time (the reshape's `like`), and one other unknown may remain, as -1."""
    unknown = [i for i, d in enumerate(dims) if not isinstance(d, int) or d == -1]
    sources = [d.value for d in dims if isinstance(d, DimOf)]
    like = max(sources, key=lambda v: sum(s is v for s in sources)) if len(unknown) > 1 and sources else None
    copy = [d.axis if isinstance(d, DimOf) and d.value is like else -1 for d in dims]
    if len(unknown) - sum(c >= 0 for c in copy) > 1:
        raise Unsupported(f"reshape of {x.type} to {len(unknown)} run-time dims, more than one of them not a dim "
                          "of a single value")
    shape = [d if isinstance(d, int) else -1 for d in dims]
    if tuple(shape) == x.type.shape:
        return x
    if like is None:
        return call.emit("reshape", x, shape=shape)
    return call.emit("reshape", x, like, shape=shape, copy=copy)


def _axes(call: NodeCall, input_index: int, since: int) -> tuple[int, ...] | None:
    """Axes given as an attribute before opset `since`, as input `input_index` from it on."""
    if call.opset >= since:
        axes = call.value(input_index, "the axes")
        return None if axes is None else tuple(int(a) for a in np.reshape(axes, -1))
    axes = call.attr("axes")
    return None if axes is None else tuple(axes)


def _norm(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise Unsupported(f"axis {axis} is out of range for rank {rank}")
    return axis % rank


def _dims(x: Value) -> list[Item]:
    return list(ShapeVector.of(x).items)


def vector_arithmetic(op: str, a: ShapeVector, b: ShapeVector) -> ShapeVector:
    """Add/Sub/Mul/Div of two shape vectors (one may have one element): ints where both are, else `Computed`."""
    if len(a.items) != len(b.items) and 1 not in (len(a.items), len(b.items)):
        raise Unsupported(f"{op} of shape vectors of {len(a.items)} and {len(b.items)} elements")
    n = max(len(a.items), len(b.items))
    pick = {"Add": int.__add__, "Sub": int.__sub__, "Mul": int.__mul__, "Div": lambda p, q: int(p / q)}[op]
    items = [pick(x, y) if isinstance(x, int) and isinstance(y, int) else Computed()
             for x, y in zip(a.items * (n // len(a.items)), b.items * (n // len(b.items)))]
    return ShapeVector(tuple(items), a.scalar and b.scalar)


@converts("Shape", since=1)
def _shape(call: NodeCall) -> Output:
    vector = call.vector(0)  # the shape of a shape vector with run-time dims is known
    items = ((len(vector.items),) if not vector.scalar else ()) if vector is not None and call.known[0] is None \
        else ShapeVector.of(call.input(0)).items
    rank = len(items)
    start, end = call.attr("start", 0), call.attr("end", rank)
    return ShapeVector(items[slice(*(min(max(b + rank if b < 0 else b, 0), rank) for b in (start, end)))])


@converts("Size", since=1)
def _size(call: NodeCall) -> Output:
    x = call.input(0)
    if not x.type.is_static:
        raise Unsupported(f"Size of {x.type}, whose dims are known only at run time")
    return np.asarray(x.type.numel(), np.int64)


@converts("Gather", since=1)
def _gather(call: NodeCall) -> Output:
    axis = call.attr("axis", 0)
    vector = call.vector(0)
    if vector is not None and not vector.scalar and axis in (0, -1):
        index = call.known[1] if len(call.known) > 1 else None
        if index is not None and index.ndim <= 1:
            picked = tuple(vector.items[int(i)] for i in np.reshape(index, -1))
            return ShapeVector(picked, index.ndim == 0)
    return call.emit("take", call.input(0), call.input(1), axis=axis)


@converts("GatherElements", since=11)
def _gather_elements(call: NodeCall) -> Output:
    return call.emit("gather", call.input(0), call.input(1), axis=call.attr("axis", 0))


@converts("Concat", since=4)
def _concat(call: NodeCall) -> Output:
    vectors = [call.vector(i) for i in range(len(call.node.input))]
    if all(v is not None and not v.scalar for v in vectors) and call.attr("axis") in (0, -1):
        return ShapeVector(tuple(x for v in vectors for x in v.items))  # type: ignore[union-attr]
    return call.emit("concat", *(call.input(i) for i in range(len(call.node.input))), axis=call.attr("axis"))


@converts("Split", since=2)
def _split(call: NodeCall) -> Output:
    x = call.input(0)
    axis = _norm(call.attr("axis", 0), x.type.rank)
    n = x.type.shape[axis]
    sizes = call.value(1, "the split sizes") if call.opset >= 13 else call.attr("split")
    if sizes is None:
        if n is None:
            raise Unsupported(f"Split of dim {axis} of {x.type}, known only at run time, into equal parts")
        parts = call.attr("num_outputs", len(call.node.output))
        step = -(-n // parts)
        sizes = [min(step, n - i * step) for i in range(parts)]
    starts = np.cumsum([0, *sizes])
    return tuple(call.emit("slice", x, starts=[int(s)], ends=[int(e)], axes=[axis])
                 for s, e in zip(starts[:-1], starts[1:]))


@converts("Slice", since=1)
def _slice(call: NodeCall) -> Output:
    if call.opset < 10:
        starts, ends, axes, steps = call.attr("starts"), call.attr("ends"), call.attr("axes"), None
    else:
        starts, ends = call.value(1, "the starts"), call.value(2, "the ends")
        axes, steps = call.value(3, "the axes"), call.value(4, "the steps")
    starts, ends = [int(s) for s in starts], [int(e) for e in ends]
    axes = list(range(len(starts))) if axes is None else [int(a) for a in axes]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
    vector = call.vector(0)
    if vector is not None and not vector.scalar and axes in ([0], [-1]):
        return ShapeVector(vector.items[slice(starts[0], ends[0], steps[0])])
    return call.emit("slice", call.input(0), starts=starts, ends=ends, axes=axes, steps=steps)


def _target_shape(call: NodeCall) -> ShapeVector:
    """Input 1 of Reshape and Expand, the target shape: known at import, at least as a vector of run-time dims."""
    target = call.vector(1)
    if target is None:
        raise Unsupported("the shape (input 1) is computed at run time; kiln needs it at compile time")
    return target


@converts("Reshape", since=5)
def _reshape(call: NodeCall) -> Output:
    target = _target_shape(call)
    vector = call.vector(0)
    if vector is not None and call.known[0] is None and target.static() is not None and \
            list(target.static().reshape(-1)) in ([-1], [len(vector.items)]):
        return ShapeVector(vector.items)  # a shape with run-time dims reshaped to a vector stays one
    x = call.input(0)
    copy = not call.attr("allowzero", 0)
    dims = [(_dims(x)[i] if i < x.type.rank else 0) if copy and d == 0 else d for i, d in enumerate(target.items)]
    return reshape_to(call, x, dims)


@converts("Flatten", since=1)
def _flatten(call: NodeCall) -> Output:
    x = call.input(0)
    axis = call.attr("axis", 1)
    axis = axis + x.type.rank if axis < 0 else axis
    parts = [x.type.shape[:axis], x.type.shape[axis:]]
    return reshape_to(call, x, [-1 if None in p else math.prod(p) for p in parts])


@converts("Transpose", since=1)
def _transpose(call: NodeCall) -> Output:
    perm = call.attr("perm")
    return call.emit("transpose", call.input(0), perm=None if perm is None else list(perm))


@converts("Squeeze", since=1)
def _squeeze(call: NodeCall) -> Output:
    vector = call.vector(0)
    axes = _axes(call, 1, 13)
    if vector is not None and not vector.scalar and len(vector.items) == 1 and axes in (None, (0,), (-1,)):
        return ShapeVector(vector.items, scalar=True)
    x = call.input(0)
    dims = _dims(x)
    if axes is None:
        if None in x.type.shape:
            raise Unsupported(f"Squeeze without axes of {x.type}, whose dims are known only at run time")
        drop = {i for i, d in enumerate(dims) if d == 1}
    else:
        drop = {_norm(a, x.type.rank) for a in axes}
    return reshape_to(call, x, [d for i, d in enumerate(dims) if i not in drop])


@converts("Unsqueeze", since=1)
def _unsqueeze(call: NodeCall) -> Output:
    vector = call.vector(0)
    axes = _axes(call, 1, 13)
    if axes is None:
        raise Unsupported("Unsqueeze needs axes")
    if vector is not None and vector.scalar and axes in ((0,), (-1,)):
        return ShapeVector(vector.items)
    x = call.input(0)
    rank = x.type.rank + len(axes)
    added = {_norm(a, rank) for a in axes}
    rest = iter(_dims(x))
    return reshape_to(call, x, [1 if i in added else next(rest) for i in range(rank)])


@converts("Expand", since=8)
def _expand(call: NodeCall) -> Output:
    return expand_to(call, call.input(0), _target_shape(call))


def expand_to(call: NodeCall, x: Value, target: ShapeVector) -> Value:
    """x broadcast (ONNX's bidirectional Expand) to `target`, whose run-time dims must be 1s of x."""
    rank = max(len(target.items), x.type.rank)
    have = [1] * (rank - x.type.rank) + list(x.type.shape)
    want = [1] * (rank - len(target.items)) + list(target.items)
    shape, grown = [], {}
    for i, (h, w) in enumerate(zip(have, want)):
        if isinstance(w, Computed):
            raise Unsupported(f"Expand of dim {i} of {x.type} to a size computed at run time")
        if isinstance(w, DimOf):  # a dynamic dim is taken to be that dim, as masks expanded to a shape are
            if h is not None and h != 1:
                raise Unsupported(f"Expand of dim {i} ({h}) of {x.type} to a size known only at run time")
            shape.append(-1 if h is None else 1)
            if h == 1:
                grown[i] = w
        elif w == 1:
            shape.append(-1 if h is None else h)  # bidirectional: a target 1 keeps the input's dim
        else:
            shape.append(w)
    out = x if shape == list(x.type.shape) else call.emit("broadcast_to", x, shape=shape)
    for i, dim in grown.items():
        out = call.emit("where", _mask_along(call, dim, i, rank), out, out)
    return out


def _mask_along(call: NodeCall, dim: DimOf, axis: int, rank: int) -> Value:
    """A bool tensor of rank `rank`, 1 everywhere but `axis`, which is `dim` at run time: `where(mask, x, x)`
    broadcasts x's dim 1 there to that size (a size kiln's `broadcast_to`, whose target is static, cannot take)."""
    v = dim.value
    others = [a for a in range(v.type.rank) if a != dim.axis]
    row = call.emit("slice", v, starts=[0] * len(others), ends=[1] * len(others), axes=others) if others else v
    shape = [-1 if a == axis else 1 for a in range(rank)]
    copy = [dim.axis if a == axis else -1 for a in range(rank)]
    line = call.emit("reshape", row, row, shape=shape, copy=copy)
    return call.emit("equal", line, line)  # any bool: both branches of the where are x


@converts("ConstantOfShape", since=9)
def _constant_of_shape(call: NodeCall) -> Output:
    fill = call.attr("value")
    fill = np.zeros(1, np.float32) if fill is None else fill
    vector = call.vector(0)
    if vector is not None and vector.static() is None:  # torch's ones(n, n) for a run-time n
        return expand_to(call, call.constant(fill.reshape([1] * len(vector.items))), vector)
    shape = call.value(0, "the shape")
    return np.full([int(d) for d in shape], fill.reshape(-1)[0], fill.dtype)


@converts("Range", since=11)
def _range(call: NodeCall) -> Output:
    limit = call.vector(1)
    if limit is not None and limit.scalar and isinstance(limit.items[0], DimOf):
        return _range_of_dim(call, limit.items[0])
    start, limit, delta = (np.reshape(call.value(i, what), -1)[0]
                           for i, what in enumerate(("the start", "the limit", "the delta")))
    return np.arange(start, limit, delta, dtype=start.dtype)


def _range_of_dim(call: NodeCall, n: DimOf) -> Value:
    """`Range(0, n, 1)` for a run-time dim n (torch's `arange(x.shape[i])`): an exclusive cumsum of ones along that
    dim of its value (one row of it, cast to bool and or-ed with its negation, so its contents never matter)."""
    start, delta = (np.reshape(call.value(i, what), -1)[0] for i, what in ((0, "the start"), (2, "the delta")))
    if start != 0 or delta != 1:
        raise Unsupported(f"Range from {start} by {delta} to a run-time limit; kiln makes only 0, 1, ..., n - 1")
    v, rank = n.value, n.value.type.rank
    others = [a for a in range(rank) if a != n.axis]
    row = call.emit("slice", v, starts=[0] * len(others), ends=[1] * len(others), axes=others) if others else v
    ones = ones_like(call, call.emit("reshape", row, v, shape=[-1], copy=[n.axis]), DType.from_numpy(start.dtype))
    return call.emit("cumsum", ones, axis=0, exclusive=True)


def ones_like(call: NodeCall, v: Value, dtype: DType) -> Value:
    """Ones of `dtype` in v's shape, `?` dims included: v cast to bool and or-ed with its negation, so its contents
    never matter."""
    true = call.emit("cast", v, dtype=DType.bool)
    return call.emit("cast", call.emit("logical_or", true, call.emit("logical_not", true)), dtype=dtype)
