"""Relax lowerings of pad and resize (transposed convolutions are with the convolutions in `nn_ops`)."""

from __future__ import annotations

from tvm import relax
from tvm.relax import op as R

from kiln.ir.ops.spatial import resize_taps

from .rule import OpCall, RelaxResult, relax_rule

_TVM_PAD_MODE = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}


@relax_rule("pad")
def _pad(call: OpCall) -> RelaxResult:
    """Negative pads as one strided slice (ends from the possibly symbolic shape), then Relax's pad."""
    a, x = call.attrs, call.args[0]
    shape = call.shape(0)
    cut = [i for i, (b, e) in enumerate(zip(a["before"], a["after"])) if b < 0 or e < 0]
    if cut:
        x = call.emit(R.strided_slice(x, cut, [max(-a["before"][i], 0) for i in cut],
                                      [shape[i] - max(-a["after"][i], 0) for i in cut]))
    widths = [w for b, e in zip(a["before"], a["after"]) for w in (max(b, 0), max(e, 0))]
    if not any(widths):
        return x
    return R.nn.pad(x, widths, _TVM_PAD_MODE[a["mode"]], a["value"])


@relax_rule("resize")
def _resize(call: OpCall) -> RelaxResult:
    """Axis by axis, gathers at the op's taps blended by constant weights, so TVM computes just what the
    reference does (Relax's resize2d derives its scale from the sizes, not ONNX's given scales); extrapolated
    outputs are a `where` against the extrapolation value."""
    a, y, dtype = call.attrs, call.args[0], call.dtype()
    rank = call.types[0].rank
    for axis, n_out in enumerate(a["size"], 2):
        idx, w, outside = resize_taps(a, axis - 2, call.types[0].shape[axis])
        shape = [n_out if i == axis else 1 for i in range(rank)]
        if a["mode"] == "nearest":
            y = call.emit(R.take(y, relax.const(idx[0].astype("int64")), axis))
        else:
            total = None
            for i, wi in zip(idx, w):
                term = R.multiply(call.emit(R.take(y, relax.const(i.astype("int64")), axis)),
                                  relax.const(wi.reshape(shape).astype(dtype)))
                total = term if total is None else R.add(total, term)
            y = call.emit(total)
        if outside is not None:
            y = call.emit(R.where(relax.const(outside.reshape(shape)), relax.const(a["extrapolation"], dtype), y))
    return y
