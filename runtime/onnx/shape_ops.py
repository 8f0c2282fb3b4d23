"""ONNX lowerings of kiln's data-movement ops: transpose, reshape, broadcast_to, concat, slice, take, gather, tile,
scatter_nd.

They move values without computing on them, so they run in the operands' own dtype (`Trait.EXACT`).
"""

from __future__ import annotations

import numpy as np

from kiln.ir import DType
from kiln.ir.ops.common import norm_axis
from kiln.ir.ops.shape import slice_cuts, transpose_perm

from .rule import OnnxCall, OnnxResult, onnx_rule

_INT64 = np.iinfo(np.int64)


@onnx_rule("transpose")
def _transpose(call: OnnxCall) -> OnnxResult:
    return call.node("Transpose", call.inputs[0], perm=transpose_perm(call.attrs["perm"], call.types[0].rank))


@onnx_rule("reshape")
def _reshape(call: OnnxCall) -> OnnxResult:
    """numpy's reshape: -1 is inferred and 0 is a zero-length dim (`allowzero`), not ONNX's copied dim; a `copy`
    dim is read from `like` at run time (a Shape slice) and concatenated into the target."""
    if not call.attrs["copy"]:
        return call.node("Reshape", call.inputs[0], call.ints(call.attrs["shape"]), allowzero=1)
    dims = [call.dim(1, c) if c >= 0 else d for d, c in zip(call.attrs["shape"], call.attrs["copy"])]
    target = call.node("Concat", *(call.ints([d]) if isinstance(d, int) else d for d in dims), axis=0)
    return call.node("Reshape", call.inputs[0], target, allowzero=1)


@onnx_rule("broadcast_to")
def _broadcast_to(call: OnnxCall) -> OnnxResult:
    """Expand broadcasts both ways, so a 1 where the target says -1 keeps the input's (even dynamic) dim."""
    return call.node("Expand", call.inputs[0], call.ints([1 if d == -1 else d for d in call.attrs["shape"]]))


@onnx_rule("concat")
def _concat(call: OnnxCall) -> OnnxResult:
    return call.node("Concat", *call.inputs, axis=norm_axis("concat", call.attrs["axis"], call.types[0].rank))


@onnx_rule("slice")
def _slice(call: OnnxCall) -> OnnxResult:
    """ONNX Slice clamps its bounds as Python's `slice.indices` does, so an open end is the int64 extreme on its
    side: the start of the walk (max for a negative step, else 0) or its end (min for a negative step, else max)."""
    cuts = slice_cuts("slice", call.types[0].rank, call.attrs)
    axes = sorted(cuts)
    starts = [c.start if c.start is not None else _INT64.max if c.step < 0 else 0 for c in map(cuts.get, axes)]
    ends = [c.stop if c.stop is not None else _INT64.min if c.step < 0 else _INT64.max for c in map(cuts.get, axes)]
    return call.node("Slice", call.inputs[0], call.ints(starts), call.ints(ends), call.ints(axes),
                     call.ints([cuts[a].step for a in axes]))


@onnx_rule("take")
def _take(call: OnnxCall) -> OnnxResult:
    """numpy.take is Gather (negative indices count from the end in both)."""
    return call.node("Gather", *call.inputs, axis=norm_axis("take", call.attrs["axis"], call.types[0].rank))


@onnx_rule("gather")
def _gather(call: OnnxCall) -> OnnxResult:
    """numpy.take_along_axis is GatherElements."""
    return call.node("GatherElements", *call.inputs, axis=norm_axis("gather", call.attrs["axis"], call.types[0].rank))


@onnx_rule("tile")
def _tile(call: OnnxCall) -> OnnxResult:
    return call.node("Tile", call.inputs[0], call.ints(call.attrs["repeats"]))


@onnx_rule("scatter_nd", "scatter_nd_reduce")
def _scatter_nd(call: OnnxCall) -> OnnxResult:
    """ScatterND takes int64 indices; its reduction attribute has kiln's names."""
    idx = call.inputs[1] if call.types[1].dtype is DType.i64 else call.cast(call.inputs[1], DType.i64)
    return call.node("ScatterND", call.inputs[0], idx, call.inputs[2], reduction=call.attrs.get("reduction", "none"))
