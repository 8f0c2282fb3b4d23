"""Elementwise ops: unary math and activations, broadcasting binary arithmetic, comparisons, where, cast."""

from __future__ import annotations

import math

import numpy as np

from ..attrs import DTYPE, FINITE, Attr, one_of
from ..dtypes import DType
from ..errors import ShapeError
from ..traits import Trait
from ..types import TensorType, broadcast_axes
from .common import Check, any_dtype, boolean, define, floating, holds_values, numeric, one, same_dtype

_erf = np.frompyfunc(math.erf, 1, 1)


def _unary(name: str, fn, check: Check = floating, attrs=None, doc: str = "") -> None:
    """Register an elementwise op of one operand whose result has the operand's type."""
    def infer(ts, attrs):
        check(name, 0, ts[0])
        return (ts[0],)
    define(name, ("x",), infer, one(fn), attrs, doc, {Trait.ELEMENTWISE})


def _binary(name: str, fn, check: Check = numeric, result: DType | None = None, doc: str = "",
            commutative: bool = False) -> None:
    def infer(ts, attrs):
        for i, t in enumerate(ts):
            check(name, i, t)
        same_dtype(name, ts)
        return (TensorType.of(broadcast_axes(ts[0].axes, ts[1].axes, what=name), result or ts[0].dtype),)
    traits = {Trait.ELEMENTWISE, Trait.COMMUTATIVE} if commutative else {Trait.ELEMENTWISE}
    define(name, ("lhs", "rhs"), infer, one(fn), doc=doc, traits=traits)


def _div(a, b):
    if a.dtype.kind in "iu":  # integer division truncates toward zero, as C and torch's "trunc" mode do
        # a - fmod(a, b) is an exact multiple of b, so floor division gives the truncated quotient without the
        # abs() that overflows at the most negative value
        safe = np.where(b == 0, 1, b).astype(b.dtype)
        return np.where(b == 0, 0, (a - np.fmod(a, safe)) // safe).astype(a.dtype)
    return a / b


def _gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    erf = np.asarray(_erf(x.astype(np.float64) / math.sqrt(2)), dtype=np.float64)  # a 0-d input gives a float
    return np.asarray(0.5 * x * (1 + erf)).astype(x.dtype)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))  # as torch computes it; 0.5 * (1 + tanh(x / 2)) cancels to 0 for x << 0


_unary("neg", np.negative, numeric)
_unary("abs", np.abs, numeric)
_unary("relu", lambda x: np.maximum(x, np.zeros((), x.dtype)), numeric)
_unary("exp", np.exp)
_unary("log", np.log)
_unary("sqrt", np.sqrt)
_unary("rsqrt", lambda x: 1 / np.sqrt(x))
_unary("tanh", np.tanh)
_unary("sigmoid", _sigmoid)
_unary("silu", lambda x: x * _sigmoid(x))
_unary("gelu", _gelu, attrs={"approximate": Attr(one_of("none", "tanh"), "none")},
       doc="x * Phi(x); approximate = \"tanh\" uses the tanh form")
_unary("leaky_relu", lambda x, alpha: np.where(x >= 0, x, alpha * x).astype(x.dtype),
       attrs={"alpha": Attr(FINITE, 0.01)})

# piecewise constant: exact in any dtype, zero gradient; round is half to even (numpy's and ONNX Round's)
_unary("floor", np.floor)
_unary("ceil", np.ceil)
_unary("round", np.round, doc="to the nearest integer, halves to even")
_unary("sign", lambda x: (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype), numeric,
       doc="-1, 0 or 1; 0 for +-0 and nan, as torch.sign, TVM and onnxruntime give")
_unary("logical_not", np.logical_not, boolean)

_binary("add", np.add, commutative=True)
_binary("sub", np.subtract)
_binary("mul", np.multiply, commutative=True)
_binary("div", _div, doc="true division for floats; integer division truncates toward zero (x/0 gives 0)")
_binary("pow", np.power, floating)
_binary("maximum", np.maximum)
_binary("minimum", np.minimum)
_binary("equal", np.equal, any_dtype, DType.bool, commutative=True)
_binary("less", np.less, any_dtype, DType.bool)
_binary("greater", np.greater, any_dtype, DType.bool)
_binary("logical_and", np.logical_and, boolean, commutative=True)
_binary("logical_or", np.logical_or, boolean, commutative=True)
_binary("logical_xor", np.logical_xor, boolean, commutative=True)


def _where_infer(ts, attrs):
    if ts[0].dtype is not DType.bool:
        raise ShapeError(f"where: operand 0 (cond) has dtype {ts[0].dtype.value}, expected bool")
    same_dtype("where", ts[1:])
    return (TensorType.of(broadcast_axes(*(t.axes for t in ts), what="where"), ts[1].dtype),)


define("where", ("cond", "lhs", "rhs"), _where_infer, one(np.where), traits={Trait.ELEMENTWISE, Trait.EXACT})


def _cast(x, dtype: DType):
    if dtype is DType.bool:
        return x != 0
    if dtype.is_int_code:
        return dtype.to_code(x)
    return x.astype(dtype.numpy)


def _cast_infer(ts, attrs):
    holds_values("cast", 0, ts[0])
    if not attrs["dtype"].holds_values:
        raise ShapeError(f"cast: to {attrs['dtype'].value}, whose codes index a float table; quantize_weights codes "
                         "a weight as nf4")
    return (ts[0].with_dtype(attrs["dtype"]),)


define("cast", ("x",), _cast_infer, one(_cast), {"dtype": Attr(DTYPE)},
       doc="convert element type; floats to ints truncate toward zero, to i4/u4/i2/u2 codes also wrap modulo "
           "2**bits (DType.to_code), nonzero to bool is true",
       traits={Trait.ELEMENTWISE, Trait.EXACT})
