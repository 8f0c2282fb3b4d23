"""Reductions over axes (sum, mean, max, min) and the normalized exponentials (softmax, log_softmax)."""

from __future__ import annotations

import numpy as np

from ..attrs import BOOL, INT, INTS, Attr, optional
from ..types import TensorType
from .common import Check, define, floating, norm_axes, norm_axis, numeric, one

_REDUCE_ATTRS = {"axes": Attr(optional(INTS), None, "axes to reduce; absent means all"),
                 "keepdims": Attr(BOOL, False)}


def _reduce(name: str, fn, check: Check) -> None:
    def infer(ts, attrs):
        check(name, 0, ts[0])
        axes = norm_axes(name, attrs["axes"], ts[0].rank)
        if attrs["keepdims"]:
            shape = tuple(1 if i in axes else d for i, d in enumerate(ts[0].shape))
        else:
            shape = tuple(d for i, d in enumerate(ts[0].shape) if i not in axes)
        return (TensorType(shape, ts[0].dtype),)

    def reference(xs, attrs):
        x = xs[0]
        axes = norm_axes(name, attrs["axes"], x.ndim)
        return (np.asarray(fn(x, axis=axes, keepdims=attrs["keepdims"])).astype(x.dtype),)

    define(name, ("x",), infer, reference, _REDUCE_ATTRS)


_reduce("sum", np.sum, numeric)
_reduce("mean", np.mean, floating)
_reduce("max", np.max, numeric)
_reduce("min", np.min, numeric)


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
