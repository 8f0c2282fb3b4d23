"""Gradients of the neural-network ops: convolution, pooling, layer/RMS/batch normalization (erf is with the
elementwise rules).

There is no transposed convolution or scatter op, so:
- conv's input gradient is a convolution of the stride-dilated gradient with the flipped, in/out-swapped weight
  (padding d * (k - 1), then the forward padding cropped off); its weight gradient is a convolution of the
  input with the gradient as kernel (batch and channels swapped, stride and dilation exchanged);
- pooling gradients put each kernel offset's share of g back with `place` (dilate by the stride, shift by the
  offset, zero-pad): kernel_h * kernel_w placements for max pooling, kernel_h + kernel_w for average pooling
  (separable), a constant averaging matrix per spatial axis for adaptive pooling. All need static spatial dims.
"""

from __future__ import annotations

import math

import numpy as np

from ..builder import FunctionBuilder
from ..errors import PassError
from ..gradients import (
    GradContext,
    Grads,
    accumulate,
    count,
    emit,
    expand,
    flip,
    gradient,
    known_bool,
    matmul_along,
    pad,
    place,
    reshape_to,
    scalar,
    select,
    unsqueeze,
)
from ..graph import Op, Operand, Value
from ..ops.common import norm_axes


def _c(fb: FunctionBuilder, value: float, like: Operand) -> Value:
    return scalar(fb, value, like.type.dtype)


def _static(kind: str, what: str, dims) -> tuple[int, ...]:
    if any(d is None for d in dims):
        raise PassError(f"{kind}: the gradient needs static {what}, got {['?' if d is None else d for d in dims]}")
    return tuple(dims)


# --- convolution


@gradient("conv1d", "conv2d")
def _conv(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    fb = ctx.fb
    (g,) = out_grads
    x, w = op.operands[:2]
    n_ops = len(op.operands)
    if g is None:
        return (None,) * n_ops
    nd = w.type.rank - 2
    spatial = tuple(range(2, 2 + nd))
    dx = _conv_dx(ctx, op, g, nd, spatial) if ctx.wanted_float(op, 0) else None
    dw = _conv_dw(ctx, op, g, nd, spatial) if ctx.wanted_float(op, 1) else None
    if n_ops == 2:
        return (dx, dw)
    return (dx, dw, emit(fb, "sum", g, axes=(0, *spatial)) if ctx.wanted_float(op, 2) else None)


def _conv_dx(ctx: GradContext, op: Op, g: Value, nd: int, spatial: tuple[int, ...]) -> Value:
    fb = ctx.fb
    x, w = op.operands[:2]
    a = op.attrs
    groups = a["groups"]
    o, cg, *kernel = _static(op.kind, "weight dims", w.type.shape)
    if groups == 1:
        wt = emit(fb, "transpose", w, perm=(1, 0, *spatial))
    else:
        wt = emit(fb, "reshape", w, shape=(groups, o // groups, cg, *kernel))
        wt = emit(fb, "transpose", wt, perm=(0, 2, 1, *(s + 1 for s in spatial)))
        wt = emit(fb, "reshape", wt, shape=(cg * groups, o // groups, *kernel))
    wt = flip(fb, wt, spatial)
    gd = g
    for i, axis in enumerate(spatial):
        if a["stride"][i] > 1:
            (size,) = _static(op.kind, "spatial dims with a stride > 1", (x.type.shape[axis],))
            length = size + 2 * a["padding"][i] - a["dilation"][i] * (kernel[i] - 1)
            gd = place(fb, gd, axis, a["stride"][i], 0, length)
    full = tuple(d * (k - 1) for d, k in zip(a["dilation"], kernel))
    dxp = emit(fb, op.kind, gd, wt, stride=(1,) * nd, padding=full, dilation=a["dilation"], groups=groups)
    cut = [i for i in range(nd) if a["padding"][i]]
    if not cut:
        return dxp
    starts = tuple(a["padding"][i] for i in cut)
    ends = tuple(-a["padding"][i] if x.type.shape[spatial[i]] is None else x.type.shape[spatial[i]] + a["padding"][i]
                 for i in cut)
    return emit(fb, "slice", dxp, starts=starts, ends=ends, axes=tuple(spatial[i] for i in cut))


def _conv_dw(ctx: GradContext, op: Op, g: Value, nd: int, spatial: tuple[int, ...]) -> Value:
    """dw[o, c, t] = sum_{n, l} x_pad[n, c, l * stride + t * dilation] g[n, o, l]: a convolution over batch-as-channels
    with g as the kernel, stride and dilation exchanged (groups: one group of batch channels per weight group)."""
    fb = ctx.fb
    x, w = op.operands[:2]
    a = op.attrs
    groups = a["groups"]
    _, cg, *kernel = _static(op.kind, "weight dims", w.type.shape)
    swap = (1, 0, *spatial)
    if groups == 1:
        xt = emit(fb, "transpose", x, perm=swap)
    else:
        n, *rest = x.type.shape[:1] + x.type.shape[2:]
        xt = reshape_to(fb, x, (n, groups, cg, *rest), op.kind)
        xt = emit(fb, "transpose", xt, perm=(2, 1, 0, *(s + 1 for s in spatial)))
        xt = reshape_to(fb, xt, (cg, None if n is None else groups * n, *rest), op.kind)
    gt = emit(fb, "transpose", g, perm=swap)
    r = emit(fb, op.kind, xt, gt, stride=a["dilation"], padding=a["padding"], dilation=a["stride"], groups=groups)
    if tuple(r.type.shape[2:]) != tuple(kernel):
        r = emit(fb, "slice", r, starts=(0,) * nd, ends=tuple(kernel), axes=spatial)
    return emit(fb, "transpose", r, perm=swap)


# --- pooling


def _pool_geometry(op: Op):
    x, y = op.operands[0], op.results[0]
    kernel = op.attrs["kernel"]
    stride = op.attrs["stride"] if op.attrs["stride"] is not None else kernel
    padding = op.attrs["padding"]
    dilation = op.attrs.get("dilation", (1, 1))
    size = _static(op.kind, "spatial dims", x.type.shape[2:])
    out = _static(op.kind, "spatial dims", y.type.shape[2:])
    return kernel, stride, padding, dilation, size, out


def _crop(fb: FunctionBuilder, v: Value, padding, size) -> Value:
    cut = [i for i in range(2) if padding[i]]
    if not cut:
        return v
    return emit(fb, "slice", v, starts=tuple(padding[i] for i in cut), ends=tuple(padding[i] + size[i] for i in cut),
                axes=tuple(2 + i for i in cut))


@gradient("max_pool2d")
def _max_pool2d(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """Each window's g goes to its first maximal element in kernel row-major order (torch's choice on ties)."""
    fb = ctx.fb
    (x,), (y,), (g,) = op.operands, op.results, out_grads
    if g is None or not ctx.wanted_float(op, 0):
        return (None,)
    kernel, stride, padding, dilation, size, out = _pool_geometry(op)
    padded = [size[i] + 2 * padding[i] for i in range(2)]
    xp = x
    for i in range(2):
        xp = pad(fb, xp, 2 + i, padding[i], padding[i], -math.inf)
    one = _c(fb, 1.0, g)
    taken = total = None
    for kh in range(kernel[0]):
        row = None
        for kw in range(kernel[1]):
            starts = (kh * dilation[0], kw * dilation[1])
            ends = tuple(s + (o - 1) * st + 1 for s, o, st in zip(starts, out, stride))
            win = emit(fb, "slice", xp, starts=starts, ends=ends, axes=(2, 3), steps=tuple(stride))
            hit = emit(fb, "cast", emit(fb, "equal", win, y), dtype=g.type.dtype)
            if taken is None:
                sel = taken = hit
            else:
                sel = emit(fb, "mul", hit, emit(fb, "sub", one, taken))
                taken = emit(fb, "add", taken, sel)
            share = place(fb, emit(fb, "mul", g, sel), 3, stride[1], starts[1], padded[1])
            row = accumulate(fb, row, share)
        total = accumulate(fb, total, place(fb, row, 2, stride[0], kh * dilation[0], padded[0]))  # type: ignore
    return (_crop(fb, total, padding, size),)  # type: ignore[arg-type]


@gradient("avg_pool2d")
def _avg_pool2d(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g / divisor spread over each window; separable, so one placement per kernel row and column."""
    fb = ctx.fb
    (g,) = out_grads
    if g is None or not ctx.wanted_float(op, 0):
        return (None,)
    kernel, stride, padding, _, size, out = _pool_geometry(op)
    padded = [size[i] + 2 * padding[i] for i in range(2)]
    if op.attrs["count_include_pad"]:
        share = emit(fb, "div", g, _c(fb, float(math.prod(kernel)), g))
    else:
        inside = [np.array([sum(padding[i] <= j * stride[i] + k < padding[i] + size[i] for k in range(kernel[i]))
                            for j in range(out[i])], dtype=np.float64) for i in range(2)]
        counts = np.outer(inside[0], inside[1]).astype(g.type.dtype.numpy)
        share = emit(fb, "div", g, fb.constant(counts))
    rows = None
    for kw in range(kernel[1]):
        rows = accumulate(fb, rows, place(fb, share, 3, stride[1], kw, padded[1]))
    total = None
    for kh in range(kernel[0]):
        total = accumulate(fb, total, place(fb, rows, 2, stride[0], kh, padded[0]))  # type: ignore[arg-type]
    return (_crop(fb, total, padding, size),)  # type: ignore[arg-type]


def _bins(n: int, n_out: int) -> np.ndarray:
    """torch's adaptive averaging matrix [n_out, n]: bin i averages [floor(i n / n_out), ceil((i + 1) n / n_out))."""
    m = np.zeros((n_out, n))
    for i in range(n_out):
        s, e = i * n // n_out, -(-(i + 1) * n // n_out)
        m[i, s:e] = 1.0 / (e - s)
    return m


@gradient("adaptive_avg_pool2d")
def _adaptive_avg_pool2d(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """The pool is A_h x A_w^T per (n, c), so the gradient is A_h^T g A_w: two matmuls with constant matrices."""
    fb = ctx.fb
    (x,), (g,) = op.operands, out_grads
    if g is None or not ctx.wanted_float(op, 0):
        return (None,)
    size = _static(op.kind, "spatial dims", x.type.shape[2:])
    oh, ow = op.attrs["output_size"]
    return (matmul_along(fb, matmul_along(fb, g, 3, _bins(size[1], ow)), 2, _bins(size[0], oh)),)


# --- normalization


def _laid(fb: FunctionBuilder, v: Operand, other: tuple[int, ...]) -> Operand:
    """An affine parameter (x's dims at the normalized axes) with unit dims at the other axes, to broadcast."""
    return unsqueeze(fb, v, other) if other else v


def _reduce_other(fb: FunctionBuilder, v: Value, other: tuple[int, ...]) -> Value:
    return emit(fb, "sum", v, axes=other) if other else v


def _norm_grads(ctx: GradContext, op: Op, out_grads: Grads, centered: bool) -> Grads:
    """Gradients of a normalization over `axes` (layer norm when `centered`, else RMS norm): with xc = x - mean(x)
    (or x), s = rsqrt(mean(xc^2) + eps), xhat = xc s and gx = g * gamma,
    dx = s * (gx [- mean(gx)] - xhat * mean(gx * xhat)); d gamma = sum(g * xhat), d beta = sum(g) over the other
    axes."""
    fb = ctx.fb
    (g,) = out_grads
    x = op.operands[0]
    n_ops = len(op.operands)
    if g is None:
        return (None,) * n_ops
    axes = norm_axes(op.kind, op.attrs["axes"], x.type.rank)
    other = tuple(i for i in range(x.type.rank) if i not in axes)
    xc = emit(fb, "sub", x, emit(fb, "mean", x, axes=axes, keepdims=True)) if centered else x
    var = emit(fb, "mean", emit(fb, "mul", xc, xc), axes=axes, keepdims=True)
    scale = emit(fb, "rsqrt", emit(fb, "add", var, _c(fb, op.attrs["eps"], x)))
    xhat = emit(fb, "mul", xc, scale)
    out: list[Value | None] = [None] * n_ops
    if ctx.wanted_float(op, 0):
        gx = emit(fb, "mul", g, _laid(fb, op.operands[1], other)) if n_ops > 1 else g
        d = emit(fb, "sub", gx, emit(fb, "mean", gx, axes=axes, keepdims=True)) if centered else gx
        m = emit(fb, "mean", emit(fb, "mul", gx, xhat), axes=axes, keepdims=True)
        out[0] = emit(fb, "mul", scale, emit(fb, "sub", d, emit(fb, "mul", xhat, m)))
    if ctx.wanted_float(op, 1):
        out[1] = _reduce_other(fb, emit(fb, "mul", g, xhat), other)
    if centered and ctx.wanted_float(op, 2):
        out[2] = _reduce_other(fb, g, other)
    return tuple(out)


@gradient("layer_norm")
def _layer_norm(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    return _norm_grads(ctx, op, out_grads, centered=True)


@gradient("rms_norm")
def _rms_norm(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    return _norm_grads(ctx, op, out_grads, centered=False)


@gradient("batch_norm")
def _batch_norm(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """Training differentiates through the batch statistics (and the running-stat updates, results 1 and 2);
    evaluation through the running statistics. A training flag that is not a constant is selected at run time."""
    fb = ctx.fb
    x, gamma, beta, rm, rv, training = op.operands
    if all(g is None for g in out_grads):
        return (None,) * 6
    mode = known_bool(fb, training)
    if mode is True:
        grads = _bn_train(ctx, op, out_grads)
    elif mode is False:
        grads = _bn_eval(ctx, op, out_grads)
    else:
        t, e = _bn_train(ctx, op, out_grads), _bn_eval(ctx, op, out_grads)
        grads = tuple(select(fb, training, a, b) for a, b in zip(t, e))
    return tuple(gr if gr is not None and ctx.wanted_float(op, i) else None for i, gr in enumerate(grads)) + (None,)


def _chan(fb: FunctionBuilder, v: Operand, rank: int) -> Operand:
    """A per-channel [C] vector as [C, 1, ...], broadcasting against x [N, C, ...]."""
    return v if rank == 2 else emit(fb, "reshape", v, shape=(-1, *(1,) * (rank - 2)))


def _bn_train(ctx: GradContext, op: Op, out_grads: Grads) -> tuple[Value | None, ...]:
    fb = ctx.fb
    x, gamma, _, _, _, _ = op.operands
    g0, g1, g2 = out_grads
    mom, rank = op.attrs["momentum"], x.type.rank
    axes = (0, *range(2, rank))
    mu = emit(fb, "mean", x, axes=axes, keepdims=True)
    xc = emit(fb, "sub", x, mu)
    var = emit(fb, "mean", emit(fb, "mul", xc, xc), axes=axes, keepdims=True)
    rstd = emit(fb, "rsqrt", emit(fb, "add", var, _c(fb, op.attrs["eps"], x)))
    dx = dgamma = dbeta = drm = drv = None
    if g0 is not None:
        xhat = emit(fb, "mul", xc, rstd)
        gx = emit(fb, "mul", g0, _chan(fb, gamma, rank))
        m1 = emit(fb, "mean", gx, axes=axes, keepdims=True)
        m2 = emit(fb, "mean", emit(fb, "mul", gx, xhat), axes=axes, keepdims=True)
        dx = emit(fb, "mul", rstd, emit(fb, "sub", emit(fb, "sub", gx, m1), emit(fb, "mul", xhat, m2)))
        dgamma = emit(fb, "sum", emit(fb, "mul", g0, xhat), axes=axes)
        dbeta = emit(fb, "sum", g0, axes=axes)
    if g1 is not None or g2 is not None:
        n = count(fb, x, axes, x.type.dtype)
        if g1 is not None:  # new_mean = (1 - m) rm + m mean(x)
            share = emit(fb, "mul", _chan(fb, g1, rank), emit(fb, "div", _c(fb, mom, x), n))
            dx = accumulate(fb, dx, expand(fb, share, x))
            drm = emit(fb, "mul", g1, _c(fb, 1 - mom, g1))
        if g2 is not None:  # new_var = (1 - m) rv + m n / (n - 1) var(x)
            factor = emit(fb, "div", _c(fb, 2 * mom, x), emit(fb, "sub", n, _c(fb, 1.0, x)))
            dx = accumulate(fb, dx, emit(fb, "mul", emit(fb, "mul", _chan(fb, g2, rank), factor), xc))
            drv = emit(fb, "mul", g2, _c(fb, 1 - mom, g2))
    return (dx, dgamma, dbeta, drm, drv)


def _bn_eval(ctx: GradContext, op: Op, out_grads: Grads) -> tuple[Value | None, ...]:
    fb = ctx.fb
    x, gamma, _, rm, rv, _ = op.operands
    g0, g1, g2 = out_grads
    rank = x.type.rank
    axes = (0, *range(2, rank))
    dx = dgamma = dbeta = drm = drv = None
    if g0 is not None:
        rstd = emit(fb, "rsqrt", emit(fb, "add", rv, _c(fb, op.attrs["eps"], rv)))
        scale = emit(fb, "mul", gamma, rstd)
        dx = emit(fb, "mul", g0, _chan(fb, scale, rank))
        total = emit(fb, "sum", g0, axes=axes)
        centered = emit(fb, "sum", emit(fb, "mul", g0, emit(fb, "sub", x, _chan(fb, rm, rank))), axes=axes)
        dgamma = emit(fb, "mul", centered, rstd)
        dbeta = total
        drm = emit(fb, "neg", emit(fb, "mul", total, scale))
        cube = emit(fb, "mul", emit(fb, "mul", rstd, rstd), rstd)
        drv = emit(fb, "mul", emit(fb, "mul", centered, gamma), emit(fb, "mul", cube, _c(fb, -0.5, rv)))
    drm = accumulate(fb, drm, g1)
    drv = accumulate(fb, drv, g2)
    return (dx, dgamma, dbeta, drm, drv)
