"""Converters of ONNX's reductions (ReduceSum ... ReduceLogSumExp), ArgMax/ArgMin, TopK and CumSum.

The Reduce ops took their axes as an attribute until opset 12 (ReduceSum) or 17 (the others) and as an optional
input since; with the input form, empty axes reduce every axis, or under `noop_with_empty_axes` none (a kiln
reduction over `axes = ()`), so ReduceL2 still gives |x| and ReduceSumSquare x * x, as onnxruntime and the
reference do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kiln.ir import DType, Value

from .call import NodeCall
from .registry import Unsupported, converts

Reducer = Callable[[NodeCall, Value, "tuple[int, ...] | None", bool], Value]


def _axes(call: NodeCall, as_input: bool) -> tuple[int, ...] | None:
    """The axes to reduce, None for all; () only when the node asks for no reduction."""
    if as_input:
        given = call.value(1, "the axes")
        axes = () if given is None else tuple(int(a) for a in np.asarray(given).reshape(-1))
        if not axes:
            return () if call.attr("noop_with_empty_axes", 0) else None
        return axes
    given = call.attr("axes")
    return tuple(given) if given else None


def _plain(kind: str) -> Reducer:
    return lambda call, x, axes, keep: call.emit(kind, x, axes=axes, keepdims=keep)


def _sum_of(square: bool, root: bool) -> Reducer:
    def reduce(call: NodeCall, x: Value, axes: tuple[int, ...] | None, keep: bool) -> Value:
        y = call.emit("sum", call.emit("mul", x, x) if square else call.emit("abs", x), axes=axes, keepdims=keep)
        return call.emit("sqrt", y) if root else y
    return reduce


def _log_sum_exp(call: NodeCall, x: Value, axes: tuple[int, ...] | None, keep: bool) -> Value:
    """m + log(sum(exp(x - m))) with m the maximum (0 where it is -inf, so an all -inf slice gives -inf)."""
    m = call.emit("max", x, axes=axes, keepdims=True)
    m = call.emit("where", call.emit("equal", m, call.constant(-np.inf, like=x)), call.constant(0.0, like=x), m)
    total = call.emit("sum", call.emit("exp", call.emit("sub", x, m)), axes=axes, keepdims=keep)
    shift = m if keep else call.emit("max", m, axes=axes, keepdims=False)
    return call.emit("add", call.emit("log", total), shift)


def _extreme(kind: str) -> Reducer:
    """max or min; on bool, through u8 (kiln's max and min are numeric), as ONNX's any and all."""
    def reduce(call: NodeCall, x: Value, axes: tuple[int, ...] | None, keep: bool) -> Value:
        if x.type.dtype is not DType.bool:
            return call.emit(kind, x, axes=axes, keepdims=keep)
        y = call.emit(kind, call.emit("cast", x, dtype=DType.u8), axes=axes, keepdims=keep)
        return call.emit("cast", y, dtype=DType.bool)
    return reduce


def _log_sum(call: NodeCall, x: Value, axes: tuple[int, ...] | None, keep: bool) -> Value:
    return call.emit("log", call.emit("sum", x, axes=axes, keepdims=keep))


_REDUCERS: dict[str, Reducer] = {
    "ReduceSum": _plain("sum"), "ReduceMean": _plain("mean"), "ReduceMax": _extreme("max"),
    "ReduceMin": _extreme("min"), "ReduceLogSum": _log_sum,
    "ReduceProd": _plain("prod"), "ReduceL1": _sum_of(square=False, root=False),
    "ReduceL2": _sum_of(square=True, root=True), "ReduceSumSquare": _sum_of(square=True, root=False),
    "ReduceLogSumExp": _log_sum_exp,
}
_LATE = [op for op in _REDUCERS if op != "ReduceSum"]  # axes became an input in opset 18, ReduceSum's in 13


# What a reduction over no element gives where kiln's (numpy's) has no identity: ONNX's -inf / +inf (the least
# / greatest value of an integer or bool type).
_EMPTY = {"ReduceMax": -np.inf, "ReduceMin": np.inf, "ReduceLogSumExp": -np.inf}


def _empty(call: NodeCall, x: Value, axes: tuple[int, ...] | None, keep: bool) -> Value:
    """The constant result of reducing static axes of which one has no element."""
    rank = x.type.rank
    picked = set(range(rank)) if axes is None else {a % rank for a in axes}
    shape = [1 if i in picked else d for i, d in enumerate(x.type.shape) if keep or i not in picked]
    if any(d is None for d in shape):
        raise Unsupported(f"an empty reduction of {x.type} with a dynamic result shape")
    fill, dtype = _EMPTY[call.node.op_type], x.type.dtype.numpy
    if not np.issubdtype(dtype, np.floating):
        info = np.iinfo(np.uint8 if dtype == np.bool_ else dtype)
        fill = info.min if fill < 0 else info.max
    return call.constant(np.full(shape, fill).astype(dtype))


def _reduce(as_input: bool) -> Callable[[NodeCall], Value]:
    def convert(call: NodeCall) -> Value:
        x, axes, keep = call.input(0), _axes(call, as_input), bool(call.attr("keepdims", 1))
        reduced = range(x.type.rank) if axes is None else axes
        if call.node.op_type in _EMPTY and any(x.type.shape[a] == 0 for a in reduced):
            return _empty(call, x, axes, keep)
        return _REDUCERS[call.node.op_type](call, x, axes, keep)
    return convert


converts("ReduceSum", since=1, until=12)(_reduce(as_input=False))
converts("ReduceSum", since=13)(_reduce(as_input=True))
converts(*_LATE, since=1, until=17)(_reduce(as_input=False))
converts(*_LATE, since=18)(_reduce(as_input=True))


@converts("ArgMax", "ArgMin", since=1)
def _arg(call: NodeCall) -> Value:
    kind = "argmax" if call.node.op_type == "ArgMax" else "argmin"
    return call.emit(kind, call.input(0), axis=call.attr("axis", 0), keepdims=bool(call.attr("keepdims", 1)),
                     select_last_index=bool(call.attr("select_last_index", 0)))


def _scalar_int(call: NodeCall, i: int, what: str) -> int:
    value = call.value(i, what)
    if value is None or np.asarray(value).size != 1:
        raise Unsupported(f"{what} (input {i}) must be one integer")
    return int(np.asarray(value).reshape(-1)[0])


@converts("TopK", since=1, until=9)
def _topk_attr(call: NodeCall) -> Sequence[Value]:
    return call.emit_many("topk", call.input(0), k=call.attr("k"), axis=call.attr("axis", -1))


@converts("TopK", since=10)
def _topk(call: NodeCall) -> Sequence[Value]:
    """k as an input; `sorted = 0` leaves the order open, so kiln's sorted order serves it too."""
    return call.emit_many("topk", call.input(0), k=_scalar_int(call, 1, "k"), axis=call.attr("axis", -1),
                          largest=bool(call.attr("largest", 1)))


@converts("CumSum", since=11)
def _cumsum(call: NodeCall) -> Value:
    return call.emit("cumsum", call.input(0), axis=_scalar_int(call, 1, "the axis"),
                     exclusive=bool(call.attr("exclusive", 0)), reverse=bool(call.attr("reverse", 0)))
