"""Matrix products: batched broadcasting matmul, Burn-layout linear, and the LoRA and DoRA derivations."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..attrs import FINITE, Attr
from ..errors import ShapeError
from ..types import Axis, TensorType, broadcast_axes, broadcast_shapes
from .common import define, numeric, one, same_dtype


def _same_dim(op: str, a: Axis, b: Axis, what: str | Callable[[], str]) -> Axis:
    """The dim two operands agree on; `what` names them, or makes the name, only on error (matmuls build many)."""
    if isinstance(a, int) and isinstance(b, int) and a != b:
        raise ShapeError(f"{op}: {what() if callable(what) else what} differ ({a} vs {b})")
    return a if a is not None else b


def matmul_type(op: str, a: TensorType, b: TensorType) -> TensorType:
    """numpy matmul typing: 1-D operands are promoted and the added dim dropped; batch dims broadcast."""
    for i, t in enumerate((a, b)):
        numeric(op, i, t)
        if t.rank == 0:
            raise ShapeError(f"{op}: operand {i} is a scalar; matmul needs rank >= 1")
    same_dtype(op, (a, b))
    sa = a.axes if a.rank > 1 else (1, *a.axes)
    sb = b.axes if b.rank > 1 else (*b.axes, 1)
    _same_dim(op, sa[-1], sb[-2],
              lambda: f"contracted dims of operand 0 {list(a.shape)} and operand 1 {list(b.shape)}")
    batch = broadcast_axes(sa[:-2], sb[:-2], what=f"{op} batch dims")
    return TensorType.of((*batch, *(sa[-2:-1] if a.rank > 1 else ()), *(sb[-1:] if b.rank > 1 else ())), a.dtype)


define("matmul", ("lhs", "rhs"), lambda ts, attrs: (matmul_type("matmul", *ts),), one(np.matmul))


def _linear_infer(ts, attrs):
    if ts[1].rank != 2:
        raise ShapeError(f"linear: operand 1 (weight) must be [in, out], got {ts[1]}")
    out = matmul_type("linear", ts[0], ts[1])
    if len(ts) == 3:
        same_dtype("linear", ts)
        if ts[2].rank != 1:
            raise ShapeError(f"linear: operand 2 (bias) must be [out], got {ts[2]}")
        _same_dim("linear", ts[2].shape[0], ts[1].shape[1], "bias length and out features")
    return (out,)


def _linear(x, w, b=None):
    y = x @ w
    return y if b is None else y + b


define("linear", ("x", "weight", "bias?"), _linear_infer, one(_linear),
       doc="x @ weight + bias with weight stored [in, out], as Burn stores it")


def _adapted_type(op: str, base: TensorType, a: TensorType, b: TensorType) -> TensorType:
    """The type of base + s * (a @ b), the adapted weight of `op` (lora, dora)."""
    same_dtype(op, (base, a, b))
    if base.rank != 2 or a.rank != 2 or b.rank != 2:
        raise ShapeError(f"{op}: base, a and b must be 2-D, got {base}, {a}, {b}")
    delta = matmul_type(op, a, b)
    broadcast_shapes(base.shape, delta.shape, what=f"{op} base and a @ b")
    if delta.shape != base.shape:
        raise ShapeError(f"{op}: a @ b has shape {list(delta.shape)} but base is {list(base.shape)}")
    return base


def _lora_infer(ts, attrs):
    return (_adapted_type("lora", *ts),)


define("lora", ("base", "a", "b"), _lora_infer,
       one(lambda base, a, b, scale: base + scale * (a @ b)), {"scale": Attr(FINITE)},
       doc="base + scale * (a @ b): the LoRA derivation of an adapted weight")


def _dora_infer(ts, attrs):
    base, magnitude = _adapted_type("dora", *ts[:3]), ts[3]
    same_dtype("dora", ts)
    if magnitude.shape != base.shape[1:]:
        raise ShapeError(f"dora: magnitude must be [{base.shape[1]}] (one per output column of base {base}), "
                         f"got {magnitude}")
    return (base,)


def column_norms(w: np.ndarray) -> np.ndarray:
    """||w||_c: the L2 norm of each column of a [in, out] weight (over axis 0, one per output feature)."""
    return np.sqrt(np.sum(w * w, axis=0))


def _dora(base, a, b, magnitude, scale):
    v = base + scale * (a @ b)
    return magnitude * (v / column_norms(v))


define("dora", ("base", "a", "b", "magnitude"), _dora_infer, one(_dora), {"scale": Attr(FINITE)},
       doc="magnitude * V / ||V||_c with V = base + scale * (a @ b): the DoRA derivation (Liu et al. 2024). "
           "Weights are [in, out], so the norm is over axis 0, one per output column (PEFT's per-output-feature "
           "norm in its [out, in] layout); magnitude is [out]. The norm is not detached: gradients are exact "
           "(PEFT can optionally detach it). A zero column of V has no direction and gives NaN, as in PEFT.")
