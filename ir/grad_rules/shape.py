"""Gradients of data movement: transpose, reshape, broadcast_to, concat, slice, take, gather, tile, scatter_nd
(and scatter_nd_reduce: add, mul, max and min).

take and gather have no scatter-add op to invert them, so their gradients are built from a one-hot encoding of
the indices, `equal(indices, iota)` with a constant iota over the indexed axis (which must be static):
- take: the one-hot [K, n] (K = index count) as a matmul against the gradient with the index dims merged, so it
  costs O(|g| * n) multiply-adds and O(K * n) memory (an embedding of V rows: a [tokens, V] one-hot);
- gather: a `where` of the one-hot against the gradient summed over the indexed axis: O(|indices| * n) work and
  memory.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import PassError
from ..gradients import (
    BIG,
    Emitter,
    GradContext,
    Grads,
    emit,
    fill,
    flip,
    gradient,
    is_float,
    move_back,
    move_last,
    pad,
    place,
    product_of_others,
    reshape_target,
    reshape_to,
    scalar,
    split_zeros,
    unbroadcast,
    unsqueeze,
)
from ..graph import Op, Operand, Value
from ..ops.common import norm_axis
from ..ops.shape import slice_cuts


def _single(ctx: GradContext, op: Op, out_grads: Grads) -> Value | None:
    x, (g,) = op.operands[0], out_grads
    return g if g is not None and is_float(x) and ctx.wanted(0) else None


@gradient("transpose")
def _transpose(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    g = _single(ctx, op, out_grads)
    if g is None:
        return (None,)
    perm = op.attrs["perm"]
    if perm is None:
        return (emit(ctx, "transpose", g),)
    return (emit(ctx, "transpose", g, perm=tuple(int(i) for i in np.argsort(perm))),)


@gradient("reshape")
def _reshape(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """Reshape back, copying x's dynamic dims from x itself; `like` is read for its shape only."""
    g = _single(ctx, op, out_grads)
    x = op.operands[0]
    back = None if g is None else reshape_to(ctx, g, x.type.shape, "reshape", like=x)
    return (back,) + (None,) * (len(op.operands) - 1)


@gradient("broadcast_to")
def _broadcast_to(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    g = _single(ctx, op, out_grads)
    return (None if g is None else unbroadcast(ctx, g, op.operands[0].type),)


@gradient("concat")
def _concat(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """Each operand's slice of g. A slice needs its bounds: counted from the start while the sizes before the
    operand are static, from the end while those after it are."""
    (g,) = out_grads
    xs = op.operands
    if g is None:
        return (None,) * len(xs)
    axis = norm_axis("concat", op.attrs["axis"], xs[0].type.rank)
    sizes = [x.type.shape[axis] for x in xs]
    out: list[Value | None] = []
    for i, x in enumerate(xs):
        if not is_float(x) or not ctx.wanted(i):
            out.append(None)
            continue
        before, size, after = sizes[:i], sizes[i], sizes[i + 1:]
        if None not in before:
            start = sum(before)  # type: ignore[arg-type]
            if size is not None:
                stop = start + size
            elif None not in after:
                stop = -sum(after) if sum(after) else BIG  # type: ignore[arg-type]
            else:
                stop = None
        elif size is not None and None not in after:
            tail = sum(after)  # type: ignore[arg-type]
            start, stop = -(size + tail), (-tail if tail else BIG)
        else:
            stop = None
        if stop is None:
            raise PassError(f"concat: the gradient of operand {i} needs its offset along axis {axis}, but dynamic "
                            f"sizes lie on both sides of it ({['?' if s is None else s for s in sizes]})")
        out.append(emit(ctx, "slice", g, starts=(start,), ends=(stop,), axes=(axis,)))
    return tuple(out)


@gradient("slice")
def _slice(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g put back where the slice took it, zeros elsewhere: per sliced axis a flip (negative steps), a dilation
    (|step| > 1) and zero padding. A dynamic sliced dim is supported for step 1 from a start to the end."""
    g = _single(ctx, op, out_grads)
    if g is None:
        return (None,)
    x = op.operands[0]
    out = g
    for axis, cut in sorted(slice_cuts("slice", x.type.rank, op.attrs).items()):
        n = x.type.shape[axis]
        if n is None:
            if cut.step == 1 and (cut.start or 0) >= 0 and cut.stop is None:
                out = pad(ctx, out, axis, cut.start or 0, 0)
                continue
            raise PassError(f"slice: the gradient along dynamic axis {axis} is supported only for x[start:] "
                            f"(got start {cut.start}, end {cut.stop}, step {cut.step})")
        picked = np.arange(n)[cut]
        if picked.size == 0:  # nothing taken along this axis: the whole gradient is zero
            return (fill(ctx, 0.0, x.type.dtype, x.type.shape, x),)
        step = cut.step or 1
        if step < 0:
            out = flip(ctx, out, [axis])
            picked = picked[::-1]
        out = place(ctx, out, axis, abs(step), int(picked[0]), n)
    return (out,)


def _normalized(fb: Emitter, idx: Operand, n: int) -> Value:
    """Negative indices counted from the end, as numpy's."""
    zero = fb.constant(0, idx.type.dtype)
    wrapped = emit(fb, "add", idx, fb.constant(n, idx.type.dtype))
    return emit(fb, "where", emit(fb, "less", idx, zero), wrapped, idx)


def _static_axis(kind: str, x: Operand, axis: int) -> int:
    n = x.type.shape[axis]
    if n is None:
        raise PassError(f"{kind}: the gradient needs a static size along the indexed axis {axis} of {x.type} "
                        "(it is built from a one-hot over that axis)")
    return n


@gradient("take")
def _take(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g summed into the taken rows: a one-hot [K, n] of the indices times g with its index dims merged."""
    (x, idx), (g,) = op.operands, out_grads
    if g is None or not is_float(x) or not ctx.wanted(0):
        return (None, None)
    r, q = x.type.rank, idx.type.rank
    axis = norm_axis("take", op.attrs["axis"], r)
    n = _static_axis("take", x, axis)
    dt = x.type.dtype
    iota = ctx.constant(np.arange(n, dtype=idx.type.dtype.numpy))
    ids = _normalized(ctx, idx, n)
    if q == 0:
        hot = emit(ctx, "cast", emit(ctx, "equal", iota, ids), dtype=dt)
        hot = emit(ctx, "reshape", hot, shape=(n, *(1,) * (r - axis - 1)))
        return (emit(ctx, "mul", unsqueeze(ctx, g, [axis]), hot), None)
    pre, post = x.type.shape[:axis], x.type.shape[axis + 1:]
    k = math.prod(idx.type.shape) if idx.type.is_static else None
    merged = (*pre, k, *post)
    if q == 1 or reshape_target(merged) is not None:
        flat = ids if q == 1 else emit(ctx, "reshape", ids, shape=(-1,))
        hot = emit(ctx, "cast", emit(ctx, "equal", emit(ctx, "reshape", flat, shape=(-1, 1)), iota), dtype=dt)
        g2 = g if q == 1 else reshape_to(ctx, g, merged, "take")
        return (move_back(ctx, emit(ctx, "matmul", move_last(ctx, g2, axis), hot), axis), None)
    # several dynamic dims and no reshape target: a where of the [*I, n] one-hot, summed over the index dims
    hot = emit(ctx, "equal", unsqueeze(ctx, ids, [q]), iota)
    perm = (*range(axis), *range(axis + q, r - 1 + q), *range(axis, axis + q))  # g as [*pre, *post, *I]
    gt = unsqueeze(ctx, g if perm == tuple(range(len(perm))) else emit(ctx, "transpose", g, perm=perm), [r - 1 + q])
    picked = emit(ctx, "where", hot, gt, scalar(ctx, 0.0, dt))
    summed = emit(ctx, "sum", picked, axes=tuple(range(r - 1, r - 1 + q)))
    return (move_back(ctx, summed, axis), None)


@gradient("gather")
def _gather(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g summed into the gathered positions: where(one-hot [.., K, n, ..], g, 0) summed over K."""
    (x, idx), (g,) = op.operands, out_grads
    if g is None or not is_float(x) or not ctx.wanted(0):
        return (None, None)
    return (scatter_along(ctx, "gather", x, idx, g, norm_axis("gather", op.attrs["axis"], x.type.rank)), None)


def scatter_along(ctx: GradContext, kind: str, x: Operand, idx: Operand, g: Value, axis: int) -> Value:
    """The gradient of x for a result that picked x's elements at `idx` along `axis` (gather, topk's values): g
    summed into the picked positions."""
    r = x.type.rank
    n = _static_axis(kind, x, axis)
    iota = ctx.constant(np.arange(n, dtype=idx.type.dtype.numpy).reshape((n, *(1,) * (r - axis - 1))))
    hot = emit(ctx, "equal", unsqueeze(ctx, _normalized(ctx, idx, n), [axis + 1]), iota)
    picked = emit(ctx, "where", hot, unsqueeze(ctx, g, [axis + 1]), scalar(ctx, 0.0, x.type.dtype))
    return emit(ctx, "sum", picked, axes=(axis,))


@gradient("tile")
def _tile(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g as [r0, d0, r1, d1, ...] summed over the copies r_i (at most one dynamic dim tiled more than once)."""
    g = _single(ctx, op, out_grads)
    if g is None:
        return (None,)
    x, repeats = op.operands[0], op.attrs["repeats"]
    split = tuple(d for dim, rep in zip(x.type.shape, repeats) for d in (rep, dim))
    target = reshape_target(split)
    if target is None:
        raise PassError(f"tile: the gradient needs at most one dynamic dim in {x.type}")
    summed = emit(ctx, "sum", emit(ctx, "reshape", g, shape=target), axes=tuple(range(0, len(split), 2)))
    return (summed if summed.type.shape == x.type.shape else reshape_to(ctx, summed, x.type.shape, "tile"),)


@gradient("scatter_nd")
def _scatter_nd(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """data: g with the written slices zeroed; updates: g read at the written slices (unique indices assumed, as
    ONNX's reduction none does), a take from g with the indexed dims merged."""
    (_, idx, updates), (g,) = op.operands, out_grads
    if g is None:
        return (None, None, None)
    dd = dx = None
    if ctx.wanted_float(op, 0):
        zeros = fill(ctx, 0.0, updates.type.dtype, updates.type.shape, updates)
        dd = emit(ctx, "scatter_nd", g, idx, zeros)
    if ctx.wanted_float(op, 2):
        dx = _read_at(ctx, op, g)
    return (dd, None, dx)


def _read_at(ctx: GradContext, op: Op, g: Value) -> Value:
    """g read at each slice a scatter's indices name (one per update): a take from g with the indexed dims
    merged, negative indices counted from the end."""
    data, idx, _ = op.operands
    q = idx.type.shape[-1]
    dims = data.type.shape[:q]
    if None in dims:
        raise PassError(f"{op.kind}: the gradient of updates needs static indexed dims of {data.type}")
    strides = np.array([math.prod(dims[i + 1:]) for i in range(q)], idx.type.dtype.numpy)  # type: ignore[arg-type]
    size = ctx.constant(np.array(dims, idx.type.dtype.numpy))
    wrapped = emit(ctx, "where", emit(ctx, "less", idx, ctx.constant(0, idx.type.dtype)),
                   emit(ctx, "add", idx, size), idx)
    flat = emit(ctx, "sum", emit(ctx, "mul", wrapped, ctx.constant(strides)), axes=(-1,))
    merged = reshape_to(ctx, g, (math.prod(dims), *data.type.shape[q:]), op.kind)  # type: ignore[arg-type]
    return emit(ctx, "take", merged, flat, axis=0)


@gradient("scatter_nd_reduce")
def _scatter_nd_reduce(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """Each slot of the result combines data's element with the updates its index names (ONNX's reduction
    includes data, as torch's scatter_reduce with include_self=True): add passes g to each; mul gives each factor g
    times the product of the slot's other factors (zeros included, `product_of_others`); max and min split g
    evenly over the factors equal to the result, as torch's amax/amin and scatter_reduce do on ties."""
    (g,) = out_grads
    want_data, want_updates = ctx.wanted_float(op, 0), ctx.wanted_float(op, 2)
    if g is None or not (want_data or want_updates):
        return (None, None, None)
    data, idx, updates = op.operands
    reduction = op.attrs["reduction"]
    if reduction == "add":
        return (g if want_data else None, None, _read_at(ctx, op, g) if want_updates else None)
    if reduction == "mul":
        (zd, nd), (zu, nu) = split_zeros(ctx, data), split_zeros(ctx, updates)
        product = emit(ctx, "scatter_nd_reduce", nd, idx, nu, reduction="mul")
        zeros = emit(ctx, "scatter_nd_reduce", zd, idx, zu, reduction="add")
        dd = emit(ctx, "mul", g, product_of_others(ctx, zd, nd, product, zeros)) if want_data else None
        du = (emit(ctx, "mul", _read_at(ctx, op, g), product_of_others(
            ctx, zu, nu, _read_at(ctx, op, product), _read_at(ctx, op, zeros))) if want_updates else None)
        return (dd, None, du)
    dt, y = data.type.dtype, op.results[0]
    hit_d = emit(ctx, "cast", emit(ctx, "equal", data, y), dtype=dt)
    hit_u = emit(ctx, "cast", emit(ctx, "equal", updates, _read_at(ctx, op, y)), dtype=dt)
    share = emit(ctx, "div", g, emit(ctx, "scatter_nd_reduce", hit_d, idx, hit_u, reduction="add"))
    return (emit(ctx, "mul", hit_d, share) if want_data else None, None,
            emit(ctx, "mul", hit_u, _read_at(ctx, op, share)) if want_updates else None)
