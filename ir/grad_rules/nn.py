"""Gradients of the neural-network ops: convolution, pooling, layer/RMS/batch normalization (erf is with the
elementwise rules).

Convolutions differentiate into convolutions (there is no scatter op):
- conv's input gradient is a convolution of the stride-dilated gradient with the flipped, in/out-swapped weight
  (padding d * (k - 1), then the forward padding cropped off); its weight gradient is a convolution of the
  input with the gradient as kernel (batch and channels swapped, stride and dilation exchanged); a transposed
  convolution's input gradient is a plain conv with its window, its weight gradient conv's with g and x exchanged;
- pooling gradients put each kernel offset's share of g back with `place` (dilate by the stride, shift by the
  offset, zero-pad), axis by axis: for max pooling one placement per kernel offset along the last axis and
  one per partial offset along each outer one (kernel_h * kernel_w + kernel_h in 2-D), for average pooling
  the kernel's sum of sizes (separable), a constant averaging matrix per spatial axis for adaptive pooling. All
  need static spatial dims.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..errors import PassError
from ..gradients import (
    Emitter,
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


def _c(fb: Emitter, value: float, like: Operand) -> Value:
    return scalar(fb, value, like.type.dtype)


def _static(kind: str, what: str, dims) -> tuple[int, ...]:
    if any(d is None for d in dims):
        raise PassError(f"{kind}: the gradient needs static {what}, got {['?' if d is None else d for d in dims]}")
    return tuple(dims)


# --- convolution


@gradient("conv1d", "conv2d", "conv3d")
def _conv(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    (g,) = out_grads
    x, w = op.operands[:2]
    n_ops = len(op.operands)
    if g is None:
        return (None,) * n_ops
    nd = w.type.rank - 2
    spatial = tuple(range(2, 2 + nd))
    dx = _conv_dx(ctx, op, g, nd, spatial) if ctx.wanted_float(op, 0) else None
    dw = _conv_dw(ctx, op, x, g) if ctx.wanted_float(op, 1) else None
    if n_ops == 2:
        return (dx, dw)
    return (dx, dw, emit(ctx, "sum", g, axes=(0, *spatial)) if ctx.wanted_float(op, 2) else None)


def _conv_dx(ctx: GradContext, op: Op, g: Value, nd: int, spatial: tuple[int, ...]) -> Value:
    x, w = op.operands[:2]
    a = op.attrs
    groups = a["groups"]
    o, cg, *kernel = _static(op.kind, "weight dims", w.type.shape)
    if groups == 1:
        wt = emit(ctx, "transpose", w, perm=(1, 0, *spatial))
    else:
        wt = emit(ctx, "reshape", w, shape=(groups, o // groups, cg, *kernel))
        wt = emit(ctx, "transpose", wt, perm=(0, 2, 1, *(s + 1 for s in spatial)))
        wt = emit(ctx, "reshape", wt, shape=(cg * groups, o // groups, *kernel))
    wt = flip(ctx, wt, spatial)
    gd = g
    for i, axis in enumerate(spatial):
        if a["stride"][i] > 1:
            (size,) = _static(op.kind, "spatial dims with a stride > 1", (x.type.shape[axis],))
            length = size + 2 * a["padding"][i] - a["dilation"][i] * (kernel[i] - 1)
            gd = place(ctx, gd, axis, a["stride"][i], 0, length)
    full = tuple(d * (k - 1) for d, k in zip(a["dilation"], kernel))
    dxp = emit(ctx, op.kind, gd, wt, stride=(1,) * nd, padding=full, dilation=a["dilation"], groups=groups)
    cut = [i for i in range(nd) if a["padding"][i]]
    if not cut:
        return dxp
    starts = tuple(a["padding"][i] for i in cut)
    ends = tuple(-a["padding"][i] if x.type.shape[spatial[i]] is None else x.type.shape[spatial[i]] + a["padding"][i]
                 for i in cut)
    return emit(ctx, "slice", dxp, starts=starts, ends=ends, axes=tuple(spatial[i] for i in cut))


def _conv_dw(ctx: GradContext, op: Op, x: Operand, g: Value) -> Value:
    """dw[o, c, t] = sum_{n, l} x_pad[n, c, l * stride + t * dilation] g[n, o, l]: a convolution over batch-as-channels
    with g as the kernel, stride and dilation exchanged (groups: one group of batch channels per weight group).
    A transposed convolution's weight gradient is this with its output gradient as x and its input as g."""
    w = op.operands[1]
    a = op.attrs
    groups, nd = a["groups"], w.type.rank - 2
    kind, spatial = f"conv{nd}d", tuple(range(2, 2 + nd))
    _, cg, *kernel = _static(op.kind, "weight dims", w.type.shape)
    swap = (1, 0, *spatial)
    if groups == 1:
        xt = emit(ctx, "transpose", x, perm=swap)
    else:
        n, *rest = x.type.shape[:1] + x.type.shape[2:]
        xt = reshape_to(ctx, x, (n, groups, cg, *rest), op.kind)
        xt = emit(ctx, "transpose", xt, perm=(2, 1, 0, *(s + 1 for s in spatial)))
        xt = reshape_to(ctx, xt, (cg, None if n is None else groups * n, *rest), op.kind)
    gt = emit(ctx, "transpose", g, perm=swap)
    r = emit(ctx, kind, xt, gt, stride=a["dilation"], padding=a["padding"], dilation=a["stride"], groups=groups)
    if tuple(r.type.shape[2:]) != tuple(kernel):
        r = emit(ctx, "slice", r, starts=(0,) * nd, ends=tuple(kernel), axes=spatial)
    return emit(ctx, "transpose", r, perm=swap)


@gradient("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
def _conv_transpose(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """y = conv's input gradient applied to x, so dx = conv(g, w) with the same window, and dw is conv's weight
    gradient with the roles of input and output gradient exchanged."""
    (g,) = out_grads
    x, w = op.operands[:2]
    if g is None:
        return (None,) * len(op.operands)
    a, nd = op.attrs, w.type.rank - 2
    spatial = tuple(range(2, 2 + nd))
    dx = None
    if ctx.wanted_float(op, 0):
        dx = emit(ctx, f"conv{nd}d", g, w, stride=a["stride"], padding=a["padding"], dilation=a["dilation"],
                  groups=a["groups"])
    dw = _conv_dw(ctx, op, g, x) if ctx.wanted_float(op, 1) else None
    if len(op.operands) == 2:
        return (dx, dw)
    return (dx, dw, emit(ctx, "sum", g, axes=(0, *spatial)) if ctx.wanted_float(op, 2) else None)


# --- pooling


def _pool_geometry(op: Op):
    x, y = op.operands[0], op.results[0]
    kernel = op.attrs["kernel"]
    stride = op.attrs["stride"] if op.attrs["stride"] is not None else kernel
    padding = op.attrs["padding"]
    dilation = op.attrs.get("dilation", (1,) * len(kernel))
    size = _static(op.kind, "spatial dims", x.type.shape[2:])
    out = _static(op.kind, "spatial dims", y.type.shape[2:])
    return kernel, stride, padding, dilation, size, out


def _crop(fb: Emitter, v: Value, padding, size) -> Value:
    cut = [i for i in range(len(size)) if padding[i]]
    if not cut:
        return v
    return emit(fb, "slice", v, starts=tuple(padding[i] for i in cut), ends=tuple(padding[i] + size[i] for i in cut),
                axes=tuple(2 + i for i in cut))


@gradient("max_pool2d", "max_pool3d")
def _max_pool(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """Each window's g goes to its first maximal element in kernel row-major order (torch's choice on ties)."""
    (x,), (y,), (g,) = op.operands, op.results, out_grads
    if g is None or not ctx.wanted_float(op, 0):
        return (None,)
    kernel, stride, padding, dilation, size, out = _pool_geometry(op)
    nd = len(kernel)
    padded = [size[i] + 2 * padding[i] for i in range(nd)]
    xp = x
    for i in range(nd):
        xp = pad(ctx, xp, 2 + i, padding[i], padding[i], -math.inf)
    one = _c(ctx, 1.0, g)
    taken: Value | None = None

    def share(starts: tuple[int, ...]) -> Value:
        """g where the window at this kernel offset holds the first maximum (row-major order)."""
        nonlocal taken
        ends = tuple(s + (o - 1) * st + 1 for s, o, st in zip(starts, out, stride))
        win = emit(ctx, "slice", xp, starts=starts, ends=ends, axes=tuple(range(2, 2 + nd)), steps=tuple(stride))
        hit = emit(ctx, "cast", emit(ctx, "equal", win, y), dtype=g.type.dtype)
        if taken is None:
            sel = taken = hit
        else:
            sel = emit(ctx, "mul", hit, emit(ctx, "sub", one, taken))
            taken = emit(ctx, "add", taken, sel)
        return emit(ctx, "mul", g, sel)

    def placed(i: int, starts: tuple[int, ...]) -> Value:
        """The shares of every kernel offset extending `starts`, placed along spatial axes i and beyond."""
        total = None
        for k in range(kernel[i]):
            at = (*starts, k * dilation[i])
            part = share(at) if i == nd - 1 else placed(i + 1, at)
            total = accumulate(ctx, total, place(ctx, part, 2 + i, stride[i], k * dilation[i], padded[i]))
        return total  # type: ignore[return-value]
    return (_crop(ctx, placed(0, ()), padding, size),)


@gradient("avg_pool2d", "avg_pool3d")
def _avg_pool(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """g / divisor spread over each window; separable, so one placement per kernel offset along each axis."""
    (g,) = out_grads
    if g is None or not ctx.wanted_float(op, 0):
        return (None,)
    kernel, stride, padding, dilation, size, out = _pool_geometry(op)
    nd = len(kernel)
    padded = [size[i] + 2 * padding[i] for i in range(nd)]
    if op.attrs["count_include_pad"]:
        total = emit(ctx, "div", g, _c(ctx, float(math.prod(kernel)), g))
    else:
        inside = [np.array([sum(padding[i] <= j * stride[i] + k * dilation[i] < padding[i] + size[i]
                                for k in range(kernel[i]))
                            for j in range(out[i])], dtype=np.float64) for i in range(nd)]
        counts = functools.reduce(np.multiply.outer, inside).astype(g.type.dtype.numpy)
        total = emit(ctx, "div", g, ctx.constant(counts))
    for i in reversed(range(nd)):
        spread = None
        for k in range(kernel[i]):
            spread = accumulate(ctx, spread, place(ctx, total, 2 + i, stride[i], k * dilation[i], padded[i]))
        total = spread  # type: ignore[assignment]
    return (_crop(ctx, total, padding, size),)


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
    (x,), (g,) = op.operands, out_grads
    if g is None or not ctx.wanted_float(op, 0):
        return (None,)
    size = _static(op.kind, "spatial dims", x.type.shape[2:])
    oh, ow = op.attrs["output_size"]
    return (matmul_along(ctx, matmul_along(ctx, g, 3, _bins(size[1], ow)), 2, _bins(size[0], oh)),)


# --- normalization


def _laid(fb: Emitter, v: Operand, other: tuple[int, ...]) -> Operand:
    """An affine parameter (x's dims at the normalized axes) with unit dims at the other axes, to broadcast."""
    return unsqueeze(fb, v, other) if other else v


def _reduce_other(fb: Emitter, v: Value, other: tuple[int, ...]) -> Value:
    return emit(fb, "sum", v, axes=other) if other else v


def _norm_grads(ctx: GradContext, op: Op, out_grads: Grads, centered: bool) -> Grads:
    """Gradients of a normalization over `axes` (layer norm when `centered`, else RMS norm): with xc = x - mean(x)
    (or x), s = rsqrt(mean(xc^2) + eps), xhat = xc s and gx = g * gamma,
    dx = s * (gx [- mean(gx)] - xhat * mean(gx * xhat)); d gamma = sum(g * xhat), d beta = sum(g) over the other
    axes."""
    (g,) = out_grads
    x = op.operands[0]
    n_ops = len(op.operands)
    if g is None:
        return (None,) * n_ops
    axes = norm_axes(op.kind, op.attrs["axes"], x.type.rank)
    other = tuple(i for i in range(x.type.rank) if i not in axes)
    xc = emit(ctx, "sub", x, emit(ctx, "mean", x, axes=axes, keepdims=True)) if centered else x
    var = emit(ctx, "mean", emit(ctx, "mul", xc, xc), axes=axes, keepdims=True)
    scale = emit(ctx, "rsqrt", emit(ctx, "add", var, _c(ctx, op.attrs["eps"], x)))
    xhat = emit(ctx, "mul", xc, scale)
    out: list[Value | None] = [None] * n_ops
    if ctx.wanted_float(op, 0):
        gx = emit(ctx, "mul", g, _laid(ctx, op.operands[1], other)) if n_ops > 1 else g
        d = emit(ctx, "sub", gx, emit(ctx, "mean", gx, axes=axes, keepdims=True)) if centered else gx
        m = emit(ctx, "mean", emit(ctx, "mul", gx, xhat), axes=axes, keepdims=True)
        out[0] = emit(ctx, "mul", scale, emit(ctx, "sub", d, emit(ctx, "mul", xhat, m)))
    if ctx.wanted_float(op, 1):
        out[1] = _reduce_other(ctx, emit(ctx, "mul", g, xhat), other)
    if centered and ctx.wanted_float(op, 2):
        out[2] = _reduce_other(ctx, g, other)
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
    x, gamma, beta, rm, rv, training = op.operands
    if all(g is None for g in out_grads):
        return (None,) * 6
    mode = known_bool(ctx, training)
    if mode is True:
        grads = _bn_train(ctx, op, out_grads)
    elif mode is False:
        grads = _bn_eval(ctx, op, out_grads)
    else:
        t, e = _bn_train(ctx, op, out_grads), _bn_eval(ctx, op, out_grads)
        grads = tuple(select(ctx, training, a, b) for a, b in zip(t, e))
    return tuple(gr if gr is not None and ctx.wanted_float(op, i) else None for i, gr in enumerate(grads)) + (None,)


def _chan(fb: Emitter, v: Operand, rank: int) -> Operand:
    """A per-channel [C] vector as [C, 1, ...], broadcasting against x [N, C, ...]."""
    return v if rank == 2 else emit(fb, "reshape", v, shape=(-1, *(1,) * (rank - 2)))


def _bn_train(ctx: GradContext, op: Op, out_grads: Grads) -> tuple[Value | None, ...]:
    x, gamma, _, _, _, _ = op.operands
    g0, g1, g2 = out_grads
    mom, rank = op.attrs["momentum"], x.type.rank
    axes = (0, *range(2, rank))
    mu = emit(ctx, "mean", x, axes=axes, keepdims=True)
    xc = emit(ctx, "sub", x, mu)
    var = emit(ctx, "mean", emit(ctx, "mul", xc, xc), axes=axes, keepdims=True)
    rstd = emit(ctx, "rsqrt", emit(ctx, "add", var, _c(ctx, op.attrs["eps"], x)))
    dx = dgamma = dbeta = drm = drv = None
    if g0 is not None:
        xhat = emit(ctx, "mul", xc, rstd)
        gx = emit(ctx, "mul", g0, _chan(ctx, gamma, rank))
        m1 = emit(ctx, "mean", gx, axes=axes, keepdims=True)
        m2 = emit(ctx, "mean", emit(ctx, "mul", gx, xhat), axes=axes, keepdims=True)
        dx = emit(ctx, "mul", rstd, emit(ctx, "sub", emit(ctx, "sub", gx, m1), emit(ctx, "mul", xhat, m2)))
        dgamma = emit(ctx, "sum", emit(ctx, "mul", g0, xhat), axes=axes)
        dbeta = emit(ctx, "sum", g0, axes=axes)
    if g1 is not None or g2 is not None:
        n = count(ctx, x, axes, x.type.dtype)
        if g1 is not None:  # new_mean = (1 - m) rm + m mean(x)
            share = emit(ctx, "mul", _chan(ctx, g1, rank), emit(ctx, "div", _c(ctx, mom, x), n))
            dx = accumulate(ctx, dx, expand(ctx, share, x))
            drm = emit(ctx, "mul", g1, _c(ctx, 1 - mom, g1))
        if g2 is not None:  # new_var = (1 - m) rv + m n / (n - 1) var(x)
            factor = emit(ctx, "div", _c(ctx, 2 * mom, x), emit(ctx, "sub", n, _c(ctx, 1.0, x)))
            dx = accumulate(ctx, dx, emit(ctx, "mul", emit(ctx, "mul", _chan(ctx, g2, rank), factor), xc))
            drv = emit(ctx, "mul", g2, _c(ctx, 1 - mom, g2))
    return (dx, dgamma, dbeta, drm, drv)


def _bn_eval(ctx: GradContext, op: Op, out_grads: Grads) -> tuple[Value | None, ...]:
    x, gamma, _, rm, rv, _ = op.operands
    g0, g1, g2 = out_grads
    rank = x.type.rank
    axes = (0, *range(2, rank))
    dx = dgamma = dbeta = drm = drv = None
    if g0 is not None:
        rstd = emit(ctx, "rsqrt", emit(ctx, "add", rv, _c(ctx, op.attrs["eps"], rv)))
        scale = emit(ctx, "mul", gamma, rstd)
        dx = emit(ctx, "mul", g0, _chan(ctx, scale, rank))
        total = emit(ctx, "sum", g0, axes=axes)
        centered = emit(ctx, "sum", emit(ctx, "mul", g0, emit(ctx, "sub", x, _chan(ctx, rm, rank))), axes=axes)
        dgamma = emit(ctx, "mul", centered, rstd)
        dbeta = total
        drm = emit(ctx, "neg", emit(ctx, "mul", total, scale))
        cube = emit(ctx, "mul", emit(ctx, "mul", rstd, rstd), rstd)
        drv = emit(ctx, "mul", emit(ctx, "mul", centered, gamma), emit(ctx, "mul", cube, _c(ctx, -0.5, rv)))
    drm = accumulate(ctx, drm, g1)
    drv = accumulate(ctx, drv, g2)
    return (dx, dgamma, dbeta, drm, drv)
