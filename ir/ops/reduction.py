"""Reductions over axes (sum, mean, max, min, prod), the normalized exponentials (softmax, log_softmax), and the
ops that rank or scan along one axis (argmax, argmin, topk, cumsum)."""

from __future__ import annotations

import numpy as np

from ..attrs import BOOL, INT, INTS, Attr, optional
from ..dtypes import DType
from ..errors import ShapeError
from ..types import TensorType
from .common import Check, define, floating, norm_axes, norm_axis, numeric, one

_REDUCE_ATTRS = {"axes": Attr(optional(INTS), None, "axes to reduce; absent means all"),
                 "keepdims": Attr(BOOL, False)}


def _reduce(name: str, fn, check: Check) -> None:
    def infer(ts, attrs):
        check(name, 0, ts[0])
        axes = norm_axes(name, attrs["axes"], ts[0].rank)
        if attrs["keepdims"]:  # the reduced axes become 1, the others keep their sizes and names
            axes_out = tuple(1 if i in axes else d for i, d in enumerate(ts[0].axes))
        else:
            axes_out = tuple(d for i, d in enumerate(ts[0].axes) if i not in axes)
        return (ts[0].with_axes(axes_out),)

    def reference(xs, attrs):
        x = xs[0]
        axes = norm_axes(name, attrs["axes"], x.ndim)
        return (np.asarray(fn(x, axis=axes, keepdims=attrs["keepdims"])).astype(x.dtype),)

    define(name, ("x",), infer, reference, _REDUCE_ATTRS)


_reduce("sum", np.sum, numeric)
_reduce("mean", np.mean, floating)
_reduce("max", np.max, numeric)
_reduce("min", np.min, numeric)
_reduce("prod", np.prod, numeric)


def _softmax(x, axis):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax(x, axis):
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _normalized(name: str, fn) -> None:
    def infer(ts, attrs):
        floating(name, 0, ts[0])
        norm_axis(name, attrs["axis"], ts[0].rank)
        return (ts[0],)
    define(name, ("x",), infer, one(fn), {"axis": Attr(INT, -1)})


_normalized("softmax", _softmax)
_normalized("log_softmax", _log_softmax)


# --- along one axis: arg extremes, top k, cumulative sum


def _keep(shape, axis: int, keepdims: bool) -> tuple:
    return tuple(1 if i == axis else d for i, d in enumerate(shape)) if keepdims else shape[:axis] + shape[axis + 1:]


def _arg(name: str, fn) -> None:
    def infer(ts, attrs):
        numeric(name, 0, ts[0])
        axis = norm_axis(name, attrs["axis"], ts[0].rank)
        return (TensorType.of(_keep(ts[0].axes, axis, attrs["keepdims"]), DType.i64),)

    def reference(x, axis, keepdims, select_last_index):
        axis = norm_axis(name, axis, x.ndim)
        if select_last_index:  # the first index of the flipped axis, counted from the end
            i = x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis, keepdims=keepdims)
        else:
            i = fn(x, axis=axis, keepdims=keepdims)
        return np.asarray(i, np.int64)

    define(name, ("x",), infer, one(reference),
           {"axis": Attr(INT, 0), "keepdims": Attr(BOOL, False), "select_last_index": Attr(BOOL, False)},
           doc="i64 index of the first (or, with select_last_index, the last) extreme element along axis")


_arg("argmax", np.argmax)
_arg("argmin", np.argmin)


def _topk_infer(ts, attrs):
    numeric("topk", 0, ts[0])
    axis = norm_axis("topk", attrs["axis"], ts[0].rank)
    k, n = attrs["k"], ts[0].shape[axis]
    if k < 0 or (n is not None and k > n):
        raise ShapeError(f"topk: k = {k} is outside [0, {n}] (the length of axis {axis} of {ts[0]})")
    axes = tuple(k if i == axis else d for i, d in enumerate(ts[0].axes))
    return (ts[0].with_axes(axes), TensorType.of(axes, DType.i64))


def _topk(xs, attrs):
    """A stable sort: equal values keep the lower index first, as ONNX TopK orders them."""
    x, k, largest = xs[0], attrs["k"], attrs["largest"]
    axis = norm_axis("topk", attrs["axis"], x.ndim)
    if largest:  # ascending over the flipped axis, read backwards: descending values, lower index first on ties
        n = x.shape[axis]
        order = np.flip(n - 1 - np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    idx = np.take(order, np.arange(k), axis=axis).astype(np.int64)
    return np.take_along_axis(x, idx, axis=axis), idx


define("topk", ("x",), _topk_infer, _topk,
       {"k": Attr(INT), "axis": Attr(INT, -1), "largest": Attr(BOOL, True)},
       doc="the k largest (or smallest) elements along axis, sorted, and their i64 indices; ties: lower index first")


def _cumsum_infer(ts, attrs):
    numeric("cumsum", 0, ts[0])
    norm_axis("cumsum", attrs["axis"], ts[0].rank)
    return (ts[0],)


def _cumsum(x, axis, exclusive, reverse):
    axis = norm_axis("cumsum", axis, x.ndim)
    y = np.flip(x, axis) if reverse else x
    out = np.cumsum(y, axis=axis, dtype=x.dtype)
    if exclusive:  # shift by one: each element sums those strictly before it
        moved = np.moveaxis(out, axis, 0)
        out = np.moveaxis(np.concatenate([np.zeros_like(moved[:1]), moved[:-1]]), 0, axis)
    return np.flip(out, axis) if reverse else out


define("cumsum", ("x",), _cumsum_infer, one(_cumsum),
       {"axis": Attr(INT, 0), "exclusive": Attr(BOOL, False), "reverse": Attr(BOOL, False)},
       doc="running sum along axis (ONNX CumSum): exclusive leaves each element out, reverse sums from the end")
