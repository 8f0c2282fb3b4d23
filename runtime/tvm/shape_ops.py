"""Relax lowerings of kiln's data-movement ops: transpose, reshape, broadcast_to, concat, slice, take, gather, tile
and scatter_nd."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax import op as R

from kiln.ir import KilnError
from kiln.ir.ops.common import norm_axis
from kiln.ir.ops.shape import reshape_dims, slice_cuts

from .rule import OpCall, RelaxResult, relax_rule


@relax_rule("transpose")
def _transpose(call: OpCall) -> RelaxResult:
    perm = call.attrs["perm"]
    return R.permute_dims(call.args[0], list(perm) if perm is not None else None)


@relax_rule("reshape")
def _reshape(call: OpCall) -> RelaxResult:
    """The target with `copy` dims read from `like`'s (possibly symbolic) shape and -1 resolved from the element
    count. Relax reads a 0 in a reshape target as "keep the input dim", where kiln's 0 is a zero-length dim, so a 0
    beside a `?` dim is refused rather than lowered to a different reshape (a static empty result never gets here:
    lowering allocates it)."""
    target = reshape_dims(call.attrs, call.shape(1) if len(call.args) > 1 else None)
    if any(isinstance(d, int) and d == 0 for d in target):
        raise KilnError(f"reshape: target {list(call.attrs['shape'])} has a zero-length dim beside a dynamic one, "
                        "which the TVM build cannot make (Relax reads a 0 as 'keep the input dim')")
    if any(isinstance(d, int) and d == -1 for d in target):
        known = math.prod((d for d in target if not (isinstance(d, int) and d == -1)), start=tirx.const(1, "int64"))
        count = math.prod(call.shape(0), start=tirx.const(1, "int64"))
        inferred = tvm.sym.Analyzer().simplify(tirx.floordiv(count, known))  # b * 8 // 8 -> b, so dims unify
        target = [inferred if isinstance(d, int) and d == -1 else d for d in target]
    return R.reshape(call.args[0], list(target))


@relax_rule("broadcast_to")
def _broadcast_to(call: OpCall) -> RelaxResult:
    """-1 in the target keeps the right-aligned input dim."""
    target = call.attrs["shape"]
    padded = [tirx.const(1, "int64")] * (len(target) - call.types[0].rank) + call.shape(0)
    return R.broadcast_to(call.args[0], [p if d == -1 else d for d, p in zip(target, padded)])


@relax_rule("concat")
def _concat(call: OpCall) -> RelaxResult:
    return R.concat(list(call.args), call.attrs["axis"])


def _bounds(n: tirx.PrimExpr, cut: slice) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """Python's `slice.indices` on a symbolic length: the first index and the element count."""
    step = cut.step

    def clamp(i: int | None, default: tirx.PrimExpr, lo: tirx.PrimExpr, hi: tirx.PrimExpr) -> tirx.PrimExpr:
        if i is None:
            return default
        return tirx.max(tirx.min(n + i if i < 0 else tirx.const(i, "int64"), hi), lo)

    if step > 0:
        start = clamp(cut.start, tirx.const(0, "int64"), tirx.const(0, "int64"), n)
        stop = clamp(cut.stop, n, tirx.const(0, "int64"), n)
        count = tirx.max(tirx.floordiv(stop - start + step - 1, step), 0)
    else:
        start = clamp(cut.start, n - 1, tirx.const(-1, "int64"), n - 1)
        stop = clamp(cut.stop, tirx.const(-1, "int64"), tirx.const(-1, "int64"), n - 1)
        count = tirx.max(tirx.floordiv(start - stop - step - 1, -step), 0)
    return start, count


def _simplify(expr: tirx.PrimExpr, dims: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """Simplify a length knowing that every symbolic dim is non-negative (so a full slice stays `n`)."""
    analyzer = tvm.sym.Analyzer()
    for d in dims:
        if isinstance(d, tirx.Var):
            analyzer.update(d, tvm.sym.ConstIntBound(0, tvm.sym.ConstIntBound.POS_INF))
    return analyzer.simplify(expr)


@relax_rule("slice")
def _slice(call: OpCall) -> RelaxResult:
    """numpy basic slicing: out[i] = x[start + i * step] along each cut axis, with clamped bounds."""
    cuts = slice_cuts("slice", call.types[0].rank, call.attrs)

    def compute(x: te.Tensor) -> te.Tensor:
        geometry = {axis: (*_bounds(x.shape[axis], cut), cut.step) for axis, cut in cuts.items()}
        shape = [_simplify(geometry[a][1], x.shape) if a in geometry else d for a, d in enumerate(x.shape)]

        def element(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            return x[tuple(geometry[a][0] + v * geometry[a][2] if a in geometry else v for a, v in enumerate(i))]
        return te.compute(shape, element, name="slice")

    return call.bb.call_te(compute, call.args[0], primfunc_name_hint="slice")


def _index(i: tirx.PrimExpr, n: tirx.PrimExpr) -> tirx.PrimExpr:
    """A numpy index (negative counts from the end) as an int64 offset, clamped into [0, n) so that an index out
    of range (which the interpreter rejects) reads a wrong element rather than memory outside the tensor."""
    i = i.astype("int64")
    return tirx.max(tirx.min(tirx.Select(i < 0, i + n, i), n - 1), 0)


@relax_rule("take")
def _take(call: OpCall) -> RelaxResult:
    """numpy.take along an axis: the indices' dims replace that axis."""
    axis = norm_axis("take", call.attrs["axis"], call.types[0].rank)
    rank = call.types[1].rank

    def compute(x: te.Tensor, indices: te.Tensor) -> te.Tensor:
        shape = [*x.shape[:axis], *indices.shape, *x.shape[axis + 1:]]

        def element(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            j = _index(indices[i[axis:axis + rank]], x.shape[axis])
            return x[(*i[:axis], j, *i[axis + rank:])]
        return te.compute(shape, element, name="take")

    return call.bb.call_te(compute, *call.args, primfunc_name_hint="take")


@relax_rule("gather")
def _gather(call: OpCall) -> RelaxResult:
    """torch.gather / numpy.take_along_axis: out[..i..] = x[..indices[..i..] at axis..]."""
    axis = norm_axis("gather", call.attrs["axis"], call.types[0].rank)

    def compute(x: te.Tensor, indices: te.Tensor) -> te.Tensor:
        def element(*i: tirx.PrimExpr) -> tirx.PrimExpr:
            return x[(*i[:axis], _index(indices[i], x.shape[axis]), *i[axis + 1:])]
        return te.compute(indices.shape, element, name="gather")

    return call.bb.call_te(compute, *call.args, primfunc_name_hint="gather")




@relax_rule("tile")
def _tile(call: OpCall) -> RelaxResult:
    return R.tile(call.args[0], list(call.attrs["repeats"]))


@relax_rule("scatter_nd", "scatter_nd_reduce")
def _scatter_nd(call: OpCall) -> RelaxResult:
    """Negative indices counted from the end first (TVM's kernel reads them as they are); TVM's reductions have
    kiln's names."""
    data, idx, updates = call.args
    dims = call.types[0].shape[:call.types[1].shape[-1]]
    if None in dims:
        raise KilnError(f"scatter_nd: the indexed dims of {call.types[0]} must be static")
    dt = call.dtype(1)
    size = relax.const(np.array(dims, dt), dt)
    wrapped = call.emit(R.where(R.less(idx, relax.const(0, dt)), R.add(idx, size), idx))
    return R.scatter_nd(data, wrapped, updates, reduction=call.attrs.get("reduction", "update"))
