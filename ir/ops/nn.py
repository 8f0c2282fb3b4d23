"""Neural-network ops in torch's layouts (NCL / NCHW / NCDHW, conv weight [out, in/groups, k...]): convolution,
pooling, layer/RMS/batch normalization, and erf for exact-gelu decompositions. Convolutions exist for 1-3
spatial dims and pools for 2 and 3 (1-D pools run as 2-D over a unit dim), one kind per rank as in torch."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..attrs import BOOL, EPS, INT, INTS, Attr, number, optional
from ..dtypes import DType
from ..errors import ShapeError
from ..registry import InferFn
from ..types import Dim, TensorType
from .common import define, floating, norm_axes, one, same_dtype
from .elementwise import _erf, _unary
from .linalg import _same_dim


class Window(NamedTuple):
    """Sliding-window geometry, one int per spatial dim."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]


def _per_dim(op: str, name: str, values: tuple[int, ...], nd: int, least: int) -> tuple[int, ...]:
    """Check a window attribute holds one int >= `least` per spatial dim."""
    if len(values) != nd or any(v < least for v in values):
        raise ShapeError(f"{op}: {name} = {list(values)} must hold {nd} ints >= {least}")
    return values


def _window(op: str, attrs: Mapping[str, Any], nd: int) -> Window:
    """The op's checked stride, padding and dilation; a pool's absent stride is its kernel, as in torch."""
    stride = attrs["stride"] if attrs.get("stride") is not None else attrs["kernel"]
    return Window(_per_dim(op, "stride", stride, nd, 1), _per_dim(op, "padding", attrs["padding"], nd, 0),
                  _per_dim(op, "dilation", attrs.get("dilation", (1,) * nd), nd, 1))


def window_span(k: int, dilation: int) -> int:
    """The input extent one dilated kernel covers."""
    return dilation * (k - 1) + 1


def window_positions(padded: int, k: int, stride: int, dilation: int) -> int:
    """How many windows of a dilated kernel fit, every `stride`, in a padded input length: a conv's or pool's
    output length (floor mode), the one rule the importer and the CPU schedules use too."""
    return (padded - window_span(k, dilation)) // stride + 1


def _out_dim(op: str, axis: int, size: Dim, k: Dim, stride: int, pad: int, dilation: int) -> Dim:
    """Output length along one spatial dim; dynamic when the input or kernel length is."""
    if size is None or k is None:
        return None
    padded, span = size + 2 * pad, window_span(k, dilation)
    if padded < span:
        raise ShapeError(f"{op}: kernel span {span} is larger than the padded input ({padded}) in spatial dim "
                         f"{axis}")
    return window_positions(padded, k, stride, dilation)


def _window_shape(op: str, spatial: Sequence[Dim], kernel: Sequence[Dim], win: Window) -> tuple[Dim, ...]:
    """The output's spatial dims."""
    return tuple(_out_dim(op, i, *dims) for i, dims in enumerate(zip(spatial, kernel, *win)))


def _rank(op: str, i: int, name: str, t: TensorType, rank: int) -> None:
    """Check operand i has exactly `rank` dims."""
    if t.rank != rank:
        raise ShapeError(f"{op}: operand {i} ({name}) must have rank {rank}, got {t}")


def _windows(x: np.ndarray, kernel: Sequence[int], win: Window, fill: float) -> np.ndarray:
    """A strided view of x [N, C, *S], padded with `fill`, as windows [N, C, *out, *kernel]."""
    nd = len(kernel)
    padded = np.pad(x, [(0, 0), (0, 0), *((p, p) for p in win.padding)], constant_values=fill)
    spans = [window_span(k, d) for k, d in zip(kernel, win.dilation)]
    view = sliding_window_view(padded, spans, axis=tuple(range(2, 2 + nd)))
    steps = (*(slice(None, None, s) for s in win.stride), *(slice(None, None, d) for d in win.dilation))
    return view[(slice(None), slice(None), *steps)]


# --- convolution


def _conv_infer(op: str, nd: int) -> InferFn:
    """Typing of an nd-dimensional convolution: x [N, C, *S], weight [O, C/groups, *K], bias [O]."""
    def infer(ts, attrs):
        x, w = _conv_operands(op, nd, ts, attrs["groups"])
        if w.shape[1] is not None:
            _same_dim(op, x.shape[1], w.shape[1] * attrs["groups"],
                      "operand 0 (x) channels and operand 1 (weight) in-channels per group * groups")
        if len(ts) == 3:
            _rank(op, 2, "bias", ts[2], 1)
            _same_dim(op, ts[2].shape[0], w.shape[0], "operand 2 (bias) length and operand 1 (weight) out-channels")
        spatial = _window_shape(op, x.shape[2:], w.shape[2:], _window(op, attrs, nd))
        return (x.with_shape((x.shape[0], w.shape[0], *spatial)),)
    return infer


def _conv_operands(op: str, nd: int, ts, groups: int) -> tuple[TensorType, TensorType]:
    """x and weight of a (transposed) convolution, checked: floating, one dtype, rank nd + 2, groups dividing
    x's channels and weight's dim 0."""
    for i, t in enumerate(ts):
        floating(op, i, t)
    same_dtype(op, ts)
    x, w = ts[0], ts[1]
    _rank(op, 0, "x", x, nd + 2)
    _rank(op, 1, "weight", w, nd + 2)
    _check_groups(op, groups, x.shape[1], w.shape[0])
    return x, w


def _check_groups(op: str, groups: int, in_channels: Dim, out_channels: Dim) -> None:
    """groups must be positive and divide both the input and the output channels."""
    if groups < 1:
        raise ShapeError(f"{op}: groups = {groups} must be positive")
    for i, what, n in ((0, "x channels", in_channels), (1, "weight out-channels", out_channels)):
        if n is not None and n % groups:
            raise ShapeError(f"{op}: groups = {groups} does not divide operand {i} ({what}) = {n}")


def _conv(x, weight, bias=None, *, stride, padding, dilation, groups):
    """im2col over a strided window view, then one batched matmul per group."""
    nd, (n, c), (o, _, *kernel) = weight.ndim - 2, x.shape[:2], weight.shape
    windows = _windows(x, kernel, Window(stride, padding, dilation), 0)
    out = windows.shape[2:2 + nd]
    patch = c // groups * math.prod(kernel)
    cols = np.moveaxis(windows, 1, 1 + nd).reshape(n, math.prod(out), groups, patch).transpose(0, 2, 1, 3)
    w = weight.reshape(groups, o // groups, patch).transpose(0, 2, 1)
    y = (cols @ w).transpose(0, 1, 3, 2).reshape(n, o, *out)
    return y if bias is None else y + bias.reshape(-1, *(1,) * nd)


def _conv_attrs(nd: int) -> dict[str, Attr]:
    """torch's conv defaults: stride 1, no padding, no dilation, one group."""
    return {"stride": Attr(INTS, (1,) * nd), "padding": Attr(INTS, (0,) * nd, "zeros on both sides"),
            "dilation": Attr(INTS, (1,) * nd), "groups": Attr(INT, 1)}


for _nd in (1, 2, 3):
    define(f"conv{_nd}d", ("x", "weight", "bias?"), _conv_infer(f"conv{_nd}d", _nd), one(_conv), _conv_attrs(_nd),
           doc="cross-correlation as torch computes it; x [N, C, *S], weight [O, C/groups, *K], bias [O]")


def _conv_transpose_infer(op: str, nd: int) -> InferFn:
    """Typing of an nd-dimensional transposed convolution: x [N, C, *S], weight [C, O/groups, *K], bias [O];
    out = (S - 1) * stride - 2 * padding + dilation * (K - 1) + output_padding + 1, as torch computes it."""
    def infer(ts, attrs):
        groups = attrs["groups"]
        x, w = _conv_operands(op, nd, ts, groups)
        _same_dim(op, x.shape[1], w.shape[0], "operand 0 (x) channels and operand 1 (weight) in-channels")
        out_channels = None if w.shape[1] is None else w.shape[1] * groups
        if len(ts) == 3:
            _rank(op, 2, "bias", ts[2], 1)
            _same_dim(op, ts[2].shape[0], out_channels, "operand 2 (bias) length and the output channels")
        win = _window(op, attrs, nd)
        extra = _per_dim(op, "output_padding", attrs["output_padding"], nd, 0)
        if any(e >= s for e, s in zip(extra, win.stride)):
            raise ShapeError(f"{op}: output_padding = {list(extra)} must be smaller than stride = {list(win.stride)}")
        spatial = []
        for i, (size, k, s, p, d, e) in enumerate(zip(x.shape[2:], w.shape[2:], *win, extra)):
            n = None if size is None or k is None else (size - 1) * s - 2 * p + window_span(k, d) + e
            if n is not None and n < 1:
                raise ShapeError(f"{op}: padding {p} leaves no output along spatial dim {i}")
            spatial.append(n)
        return (x.with_shape((x.shape[0], out_channels, *spatial)),)
    return infer


def _conv_transpose(x, weight, bias=None, *, stride, padding, output_padding, dilation, groups):
    """Each input element scatters its kernel-weighted copy at stride steps; then padding is cropped off both
    sides and output_padding adds zeros at the end (before the bias)."""
    nd, (n, c, *size), (_, og, *kernel) = x.ndim - 2, x.shape, weight.shape
    full = [(s - 1) * st + window_span(k, d) for s, st, k, d in zip(size, stride, kernel, dilation)]
    out = np.zeros((n, groups, og, *full), np.result_type(x, weight))
    xg, wg = x.reshape(n, groups, c // groups, *size), weight.reshape(groups, c // groups, og, *kernel)
    for t in np.ndindex(*kernel):
        at = tuple(slice(ti * d, ti * d + (s - 1) * st + 1, st) for ti, d, s, st in zip(t, dilation, size, stride))
        out[(slice(None),) * 3 + at] += np.einsum("ngc...,gco->ngo...", xg, wg[(Ellipsis, *t)])
    out = np.pad(out.reshape(n, groups * og, *full), [(0, 0), (0, 0), *((0, e) for e in output_padding)])
    y = out[(slice(None), slice(None), *(slice(p, f - p + e) for p, f, e in zip(padding, full, output_padding)))]
    return y if bias is None else y + bias.reshape(-1, *(1,) * nd)


for _nd in (1, 2, 3):
    define(f"conv_transpose{_nd}d", ("x", "weight", "bias?"), _conv_transpose_infer(f"conv_transpose{_nd}d", _nd),
           one(_conv_transpose), {**_conv_attrs(_nd), "padding": Attr(INTS, (0,) * _nd, "cropped off both sides"),
                                 "output_padding": Attr(INTS, (0,) * _nd, "zeros added at the end")},
           doc="transposed convolution (the input gradient of conv) as torch computes it; x [N, C, *S], "
               "weight [C, O/groups, *K], bias [O]")


# --- pooling


def _pool_infer(op: str, nd: int) -> InferFn:
    """Typing of an nd-dimensional pool; like torch, padding may be at most half the kernel span."""
    def infer(ts, attrs):
        x = ts[0]
        floating(op, 0, x)
        _rank(op, 0, "x", x, nd + 2)
        kernel = _per_dim(op, "kernel", attrs["kernel"], nd, 1)
        win = _window(op, attrs, nd)
        if any(2 * p > window_span(k, d) for k, p, d in zip(kernel, win.padding, win.dilation)):
            raise ShapeError(f"{op}: padding {list(win.padding)} is more than half the kernel span")
        return (x.with_shape((*x.shape[:2], *_window_shape(op, x.shape[2:], kernel, win))),)
    return infer


def _kernel_axes(kernel: tuple[int, ...]) -> tuple[int, ...]:
    """The trailing window axes of `_windows`' view."""
    return tuple(range(-len(kernel), 0))


def _max_pool(x: np.ndarray, kernel: tuple[int, ...], win: Window, attrs: Mapping[str, Any]) -> np.ndarray:
    """Window maxima, padding with -inf so it never wins."""
    return _windows(x, kernel, win, -np.inf).max(axis=_kernel_axes(kernel))


def _avg_pool(x: np.ndarray, kernel: tuple[int, ...], win: Window, attrs: Mapping[str, Any]) -> np.ndarray:
    """Window sums over the kernel size, or over the count of real (unpadded) elements."""
    total = _windows(x, kernel, win, 0).sum(axis=_kernel_axes(kernel))
    if attrs["count_include_pad"]:
        return total / math.prod(kernel)
    inside = _windows(np.ones((1, 1, *x.shape[2:]), x.dtype), kernel, win, 0).sum(axis=_kernel_axes(kernel))
    return total / inside


def _pool(op: str, nd: int, fn: Callable[..., np.ndarray], attrs: dict[str, Attr], doc: str) -> None:
    """Register an nd-dimensional pool computing `fn(x, kernel, window, attrs)` over NC... input."""
    def reference(xs, attrs):
        return (fn(xs[0], attrs["kernel"], _window(op, attrs, nd), attrs),)
    define(op, ("x",), _pool_infer(op, nd), reference, attrs, doc)


for _nd in (2, 3):
    _pool_attrs = {"kernel": Attr(INTS), "stride": Attr(optional(INTS), None, "absent means the kernel"),
                   "padding": Attr(INTS, (0,) * _nd), "dilation": Attr(INTS, (1,) * _nd)}
    _pool(f"max_pool{_nd}d", _nd, _max_pool, _pool_attrs, doc="window maximum; padding counts as -inf")
    _pool(f"avg_pool{_nd}d", _nd, _avg_pool,
          {**_pool_attrs, "count_include_pad": Attr(BOOL, True, "divide by the whole kernel, padding included")},
          doc="window mean (a dilated window averages the elements it reads, as ONNX's AveragePool does)")


def _adaptive_infer(ts, attrs):
    """x [N, C, H, W] -> [N, C, *output_size]; a dynamic H or W still gives a static output."""
    x = ts[0]
    floating("adaptive_avg_pool2d", 0, x)
    _rank("adaptive_avg_pool2d", 0, "x", x, 4)
    size = _per_dim("adaptive_avg_pool2d", "output_size", attrs["output_size"], 2, 1)
    if 0 in x.shape[2:]:
        raise ShapeError(f"adaptive_avg_pool2d: operand 0 (x) has an empty spatial dim: {x}")
    return (x.with_shape((*x.shape[:2], *size)),)


def _bin_means(x: np.ndarray, axis: int, n_out: int) -> np.ndarray:
    """Means along `axis` over torch's adaptive bins [floor(i*n/n_out), ceil((i+1)*n/n_out)), one per output."""
    n = x.shape[axis]
    bins = [(i * n // n_out, -(-(i + 1) * n // n_out)) for i in range(n_out)]
    return np.stack([np.take(x, range(s, e), axis=axis).mean(axis=axis) for s, e in bins], axis=axis)


def _adaptive_avg_pool(x, *, output_size):
    """Separable bin means (H then W); unlike an averaging matmul it keeps an inf or nan inside its own bins."""
    return _bin_means(_bin_means(x, 2, output_size[0]), 3, output_size[1])


define("adaptive_avg_pool2d", ("x",), _adaptive_infer, one(_adaptive_avg_pool), {"output_size": Attr(INTS)},
       doc="mean over torch's adaptive bins, giving a fixed [out_h, out_w] whatever the input size")


# --- normalization


def _norm_infer(op: str, operands: tuple[str, ...]) -> InferFn:
    """x keeps its type; each affine operand must span x's dims at the normalized axes."""
    def infer(ts, attrs):
        for i, t in enumerate(ts):
            floating(op, i, t)
        same_dtype(op, ts)
        if ts[0].rank == 0:
            raise ShapeError(f"{op}: operand 0 (x) is a scalar; there is no axis to normalize")
        axes = norm_axes(op, attrs["axes"], ts[0].rank)
        if not axes:
            raise ShapeError(f"{op}: axes must name at least one axis")
        want = [ts[0].shape[a] for a in axes]
        for i, t in enumerate(ts[1:], 1):
            if t.rank != len(want) or any(a is not None and b is not None and a != b for a, b in zip(t.shape, want)):
                raise ShapeError(f"{op}: operand {i} ({operands[i].rstrip('?')}) has shape {list(t.shape)} but x's "
                                 f"dims at axes {list(axes)} are {want}")
        return (ts[0],)
    return infer


def _affine(y: np.ndarray, axes: tuple[int, ...], gamma: np.ndarray | None, beta: np.ndarray | None) -> np.ndarray:
    """y * gamma + beta with the parameters laid along the normalized axes."""
    shape = [d if i in axes else 1 for i, d in enumerate(y.shape)]
    if gamma is not None:
        y = y * gamma.reshape(shape)
    return y if beta is None else y + beta.reshape(shape)


def _moments(x: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Mean and biased variance over axes (kept), in f64 so inputs with a large common offset keep precision."""
    wide = x.astype(np.float64)
    mean = wide.mean(axis=axes, keepdims=True)
    return mean, np.mean(np.square(wide - mean), axis=axes, keepdims=True)


def _layer_norm(x, gamma=None, beta=None, *, axes, eps):
    """(x - mean) / sqrt(biased var + eps) over axes, then the affine."""
    axes = norm_axes("layer_norm", axes, x.ndim)
    mean, var = _moments(x, axes)
    return _affine((x - mean) / np.sqrt(var + eps), axes, gamma, beta)


def _rms_norm(x, gamma=None, *, axes, eps):
    """x / sqrt(mean(x^2) + eps) over axes, then gamma."""
    axes = norm_axes("rms_norm", axes, x.ndim)
    mean_square = np.mean(np.square(x.astype(np.float64)), axis=axes, keepdims=True)
    return _affine(x / np.sqrt(mean_square + eps), axes, gamma, None)


_NORM_ATTRS = {"axes": Attr(INTS, (-1,), "normalized axes; gamma and beta span x's dims there"),
               "eps": Attr(EPS, 1e-5)}
_LAYER_NORM, _RMS_NORM = ("x", "gamma?", "beta?"), ("x", "gamma?")

define("layer_norm", _LAYER_NORM, _norm_infer("layer_norm", _LAYER_NORM), one(_layer_norm), _NORM_ATTRS,
       doc="(x - mean) / sqrt(var + eps) * gamma + beta over axes (biased variance)")
define("rms_norm", _RMS_NORM, _norm_infer("rms_norm", _RMS_NORM), one(_rms_norm), _NORM_ATTRS,
       doc="x / sqrt(mean(x^2) + eps) * gamma over axes")


_BATCH_NORM = ("x", "gamma", "beta", "running_mean", "running_var", "training")


def _batch_norm_infer(ts, attrs):
    """y takes x's type (batch may be dynamic); the new running stats take the running stats' types."""
    x = ts[0]
    for i, t in enumerate(ts[:5]):
        floating("batch_norm", i, t)
    same_dtype("batch_norm", ts[:5])
    if x.rank < 2:
        raise ShapeError(f"batch_norm: operand 0 (x) must be [N, C, ...], got {x}")
    for i, t in enumerate(ts[1:5], 1):
        _rank("batch_norm", i, _BATCH_NORM[i], t, 1)
        _same_dim("batch_norm", x.shape[1], t.shape[0], f"operand 0 (x) channels and operand {i} ({_BATCH_NORM[i]}) "
                  "length")
    if ts[5].dtype is not DType.bool or ts[5].rank != 0:
        raise ShapeError(f"batch_norm: operand 5 (training flag) must be a bool scalar, got {ts[5]}")
    if not 0.0 <= attrs["momentum"] <= 1.0:
        raise ShapeError(f"batch_norm: momentum = {attrs['momentum']} is outside [0, 1]")
    return (x, ts[3], ts[4])


def _batch_statistics(x: np.ndarray, running_mean: np.ndarray, running_var: np.ndarray, momentum: float
                      ) -> tuple[np.ndarray, ...]:
    """Batch mean and biased variance over all axes but 1; running stats updated with the unbiased one, as torch."""
    axes = (0, *range(2, x.ndim))
    n = math.prod(x.shape[a] for a in axes)
    if n < 2:
        raise ValueError(f"training needs more than one value per channel, got {n}")
    mean, var = (m.reshape(-1) for m in _moments(x, axes))
    new_mean = (1 - momentum) * running_mean + momentum * mean
    new_var = (1 - momentum) * running_var + momentum * var * (n / (n - 1))
    return mean, var, new_mean, new_var


def _batch_norm(xs, attrs):
    """Three results: y, and the running mean and variance (updated while training, else as given)."""
    x, gamma, beta, running_mean, running_var, training = xs
    if bool(training):
        mean, var, running_mean, running_var = _batch_statistics(x, running_mean, running_var, attrs["momentum"])
    else:
        mean, var = running_mean, running_var
    shape = (-1, *(1,) * (x.ndim - 2))
    scale = gamma / np.sqrt(var + attrs["eps"])
    return (x - mean.reshape(shape)) * scale.reshape(shape) + beta.reshape(shape), running_mean, running_var


define("batch_norm", _BATCH_NORM, _batch_norm_infer, _batch_norm,
       {"eps": Attr(EPS, 1e-5),
        "momentum": Attr(number(0.0, 1.0), 0.1, "weight of the batch statistics in the update")},
       doc="normalize over all axes but 1: batch statistics while training (results 2 and 3 are the updated "
           "running mean and variance), the running ones otherwise (returned unchanged)")


_unary("erf", lambda x: np.asarray(_erf(x), dtype=x.dtype), doc="the Gauss error function")
