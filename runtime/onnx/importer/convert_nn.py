"""Converters of ONNX's convolution, pooling, normalization, padding and depth/space ops into kiln's spatial ops.

ONNX pads are per side (`[begin..., end...]`) where kiln's conv and pool padding is one int per dim: unequal
sides, `auto_pad` and `ceil_mode` become an explicit `pad` op ahead of the kiln op (-inf for MaxPool), and an
AveragePool whose windows then cover different counts divides by a compile-time count map.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from kiln.ir import DType, Value
from kiln.ir.ops.nn import window_positions, window_span

from .call import NodeCall
from .registry import Unsupported, converts


def _spatial(call: NodeCall, x: Value, ranks: Sequence[int] = (1, 2, 3)) -> tuple[int, ...]:
    """x's spatial dims, which must be static and of a supported count."""
    dims = x.type.shape[2:]
    if len(dims) not in ranks:
        raise Unsupported(f"{len(dims)}-D spatial input {x.type}; kiln implements {', '.join(map(str, ranks))}-D")
    if any(d is None for d in dims):
        raise Unsupported(f"dynamic spatial dims in {x.type}")
    return tuple(dims)  # type: ignore[arg-type]


def _ints(call: NodeCall, name: str, nd: int, default: int) -> tuple[int, ...]:
    v = tuple(call.attr(name, (default,) * nd))
    if len(v) != nd:
        raise Unsupported(f"{name} = {list(v)} does not hold one value per spatial dim ({nd})")
    return v


def _sides(call: NodeCall, size: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int]) -> tuple[list[int], list[int]]:
    """Begin and end padding from `pads` or `auto_pad` (SAME_*: output = ceil(input / stride))."""
    nd, auto = len(size), call.attr("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = tuple(call.attr("pads", (0,) * 2 * nd))
        if len(pads) != 2 * nd:
            raise Unsupported(f"pads = {list(pads)} does not hold {2 * nd} values")
        return list(pads[:nd]), list(pads[nd:])
    if auto == "VALID":
        return [0] * nd, [0] * nd
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        raise Unsupported(f"auto_pad = {auto!r}")
    total = [max((-(-n // s) - 1) * s + d * (k - 1) + 1 - n, 0) for n, k, s, d in zip(size, kernel, stride, dilation)]
    small = [t // 2 for t in total]
    big = [t - h for t, h in zip(total, small)]
    return (small, big) if auto == "SAME_UPPER" else (big, small)


def _pad(call: NodeCall, x: Value, begin: Sequence[int], end: Sequence[int], value: float = 0.0) -> Value:
    """x padded on its spatial dims (no op where every side is 0)."""
    if not any(begin) and not any(end):
        return x
    return call.emit("pad", x, before=(0, 0, *begin), after=(0, 0, *end), value=value)


def _channels(call: NodeCall, v: Value, rank: int) -> Value:
    """A [C] vector shaped [C, 1, ...] to broadcast over the channel axis of a rank-`rank` NC... tensor."""
    return call.emit("reshape", v, shape=(-1, *(1,) * (rank - 2)))


def _unit_dim(call: NodeCall, x: Value) -> Value:
    """NCL as NC1L, so 1-D pools run as 2-D ones."""
    return call.emit("reshape", x, shape=(-1, *x.type.shape[1:2], 1, *x.type.shape[2:]))


def _drop_unit_dim(call: NodeCall, y: Value) -> Value:
    return call.emit("reshape", y, shape=(-1, y.type.shape[1], y.type.shape[3]))


# --- convolution


@converts("Conv", since=1)
def _conv(call: NodeCall) -> Value:
    return convolve(call, call.input(0), call.input(1), call.optional(2))


def convolve(call: NodeCall, x: Value, w: Value, bias: Value | None) -> Value:
    """The convolution the node's attributes (strides, dilations, pads or auto_pad, group) describe, on x and w;
    the quantized convolutions call it with their integer operands widened to floats."""
    size = _spatial(call, x)
    nd = len(size)
    kernel = _spatial(call, w, (nd,))
    stride, dilation = _ints(call, "strides", nd, 1), _ints(call, "dilations", nd, 1)
    begin, end = _sides(call, size, kernel, stride, dilation)
    padding = begin if begin == end else [0] * nd
    if begin != end:
        x = _pad(call, x, begin, end)
    operands = (x, w) if bias is None else (x, w, bias)
    return call.emit(f"conv{nd}d", *operands, stride=stride, padding=tuple(padding), dilation=dilation,
                     groups=call.attr("group", 1))


@converts("ConvTranspose", since=1)
def _conv_transpose(call: NodeCall) -> Value:
    """ONNX's per-side pads, output_shape and auto_pad settle into one crop (or zero extension) per side of the
    uncropped transposed convolution; the common symmetric case is one kiln op."""
    x, w, bias = call.input(0), call.input(1), call.optional(2)
    size = _spatial(call, x)
    nd = len(size)
    kernel = _spatial(call, w, (nd,))
    stride, dilation = _ints(call, "strides", nd, 1), _ints(call, "dilations", nd, 1)
    extra = _ints(call, "output_padding", nd, 0)
    full = [(n - 1) * s + d * (k - 1) + 1 + e for n, s, d, k, e in zip(size, stride, dilation, kernel, extra)]
    shape, auto = call.attr("output_shape"), call.attr("auto_pad", "NOTSET")
    if shape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        want = list(shape)[-nd:] if shape is not None else [n * s for n, s in zip(size, stride)]
        total = [f - o for f, o in zip(full, want)]
        small, big = [t // 2 for t in total], [t - t // 2 for t in total]
        begin, end = (small, big) if auto == "SAME_UPPER" else (big, small)
    elif auto == "VALID":
        begin, end = [0] * nd, [0] * nd
    else:
        begin, end = _sides(call, size, kernel, stride, dilation)
    groups = call.attr("group", 1)
    if begin == end and all(0 <= b for b in begin) and all(e < s for e, s in zip(extra, stride)):
        operands = (x, w) if bias is None else (x, w, bias)
        return call.emit(f"conv_transpose{nd}d", *operands, stride=stride, padding=tuple(begin),
                         output_padding=extra, dilation=dilation, groups=groups)
    y = call.emit(f"conv_transpose{nd}d", x, w, stride=stride, dilation=dilation, groups=groups)
    y = _pad(call, y, [-b for b in begin], [e - p for e, p in zip(extra, end)])
    return y if bias is None else call.emit("add", y, _channels(call, bias, y.type.rank))


# --- normalization


@converts("BatchNormalization", since=7)
def _batch_norm(call: NodeCall) -> Value | Sequence[Value]:
    """The inference form (running statistics), or from opset 14 with training_mode = 1 the training one."""
    if call.attr("training_mode", 0):
        return _batch_norm_training(call)
    if not call.attr("spatial", 1):
        raise Unsupported("spatial = 0 (statistics per element, not per channel)")
    if len([o for o in call.node.output if o]) > 1:
        raise Unsupported("the training outputs (running and saved mean and variance) are requested")
    x, scale, bias, mean, var = (call.input(i) for i in range(5))
    training = call.constant(np.asarray(False))
    return call.emit_many("batch_norm", x, scale, bias, mean, var, training, eps=call.attr("epsilon", 1e-5))[0]


def _batch_norm_training(call: NodeCall) -> Sequence[Value]:
    """ONNX's training mode (opset 14+) as its spec states it: Y normalized by the batch mean and biased variance
    over all axes but 1, and the running outputs `input * momentum + batch * (1 - momentum)`. kiln's training
    batch_norm weighs the batch by momentum and updates with the unbiased variance (torch's rule), so this is the
    inference batch_norm on batch statistics (gradients flow through them)."""
    x, scale, bias, mean, var = (call.input(i) for i in range(5))
    axes = (0, *range(2, x.type.rank))
    batch_mean = call.emit("mean", x, axes=axes, keepdims=True)
    centered = call.emit("sub", x, batch_mean)
    batch_var = call.emit("mean", call.emit("mul", centered, centered), axes=axes, keepdims=True)
    batch_mean, batch_var = (call.emit("reshape", v, shape=(-1,)) for v in (batch_mean, batch_var))
    y = call.emit_many("batch_norm", x, scale, bias, batch_mean, batch_var, call.constant(np.asarray(False)),
                       eps=call.attr("epsilon", 1e-5))[0]
    momentum = call.attr("momentum", 0.9)
    kept, taken = call.constant(momentum, like=mean), call.constant(1.0 - momentum, like=mean)
    running = [call.emit("add", call.emit("mul", old, kept), call.emit("mul", new, taken))
               for old, new in ((mean, batch_mean), (var, batch_var))]
    return (y, *running)


def _affine(call: NodeCall, y: Value, scale: Value | None, bias: Value | None) -> Value:
    """y * scale + bias per channel of NC... y."""
    if scale is not None:
        y = call.emit("mul", y, _channels(call, scale, y.type.rank))
    return y if bias is None else call.emit("add", y, _channels(call, bias, y.type.rank))


@converts("InstanceNormalization", since=6)
def _instance_norm(call: NodeCall) -> Value:
    x = call.input(0)
    y = call.emit("layer_norm", x, axes=tuple(range(2, x.type.rank)), eps=call.attr("epsilon", 1e-5))
    return _affine(call, y, call.input(1), call.input(2))


@converts("LayerNormalization", since=17)
def _layer_norm(call: NodeCall) -> Sequence[Value | None]:
    """layer_norm over axes axis..rank-1; a Scale or B of a smaller (broadcast) shape multiplies afterwards. The
    Mean and InvStdDev outputs are computed where the node names them."""
    x, scale, bias = call.input(0), call.input(1), call.optional(2)
    rank, eps = x.type.rank, call.attr("epsilon", 1e-5)
    axis = call.attr("axis", -1) % rank
    axes = tuple(range(axis, rank))
    normalized = tuple(x.type.shape[axis:])
    if scale.type.shape == normalized and (bias is None or bias.type.shape == normalized):
        y = call.emit("layer_norm", x, *((scale,) if bias is None else (scale, bias)), axes=axes, eps=eps)
    else:
        y = call.emit("mul", call.emit("layer_norm", x, axes=axes, eps=eps), scale)
        y = y if bias is None else call.emit("add", y, bias)
    outputs = list(call.node.output) + [""] * 3
    if not outputs[1] and not outputs[2]:
        return (y,)
    mean = call.emit("mean", x, axes=axes, keepdims=True)
    centered = call.emit("sub", x, mean)
    var = call.emit("mean", call.emit("mul", centered, centered), axes=axes, keepdims=True)
    return y, mean, call.emit("rsqrt", call.emit("add", var, call.constant(eps, like=x)))


@converts("GroupNormalization", since=18)
def _group_norm(call: NodeCall) -> Value:
    """Each group's channels and spatial dims normalized together (x as [N * G, C / G * S]); scale and bias are
    per group before opset 21 and per channel from 21."""
    x, scale, bias = call.input(0), call.input(1), call.input(2)
    groups, shape = call.required("num_groups"), x.type.shape
    if any(d is None for d in shape[1:]):
        raise Unsupported(f"dynamic channel or spatial dims in {x.type}")
    c = shape[1]
    if c % groups:
        raise Unsupported(f"num_groups = {groups} does not divide the {c} channels")
    flat = call.emit("reshape", x, shape=(-1, c // groups * math.prod(shape[2:])))
    y = call.emit("reshape", call.emit("layer_norm", flat, eps=call.attr("epsilon", 1e-5)), shape=(-1, *shape[1:]))
    if call.opset < 21:
        scale, bias = (call.emit("reshape", call.emit("broadcast_to", call.emit("reshape", v, shape=(groups, 1)),
                                                      shape=(groups, c // groups)), shape=(c,))
                       for v in (scale, bias))
    return _affine(call, y, scale, bias)


@converts("LRN", since=1)
def _lrn(call: NodeCall) -> Value:
    """x / (bias + alpha / size * sum of x^2 over a window of channels)^beta; the window sum is a zero-padded
    average pool along the channels of x viewed as [N, 1, C, rest]."""
    x = call.input(0)
    size, shape = call.required("size"), x.type.shape
    if any(d is None for d in shape[1:]):
        raise Unsupported(f"dynamic channel or spatial dims in {x.type}")
    square = call.emit("reshape", call.emit("mul", x, x), shape=(-1, 1, shape[1], math.prod(shape[2:])))
    square = _pad(call, square, [(size - 1) // 2, 0], [size // 2, 0])
    window = call.emit("avg_pool2d", square, kernel=(size, 1), stride=(1, 1))
    base = call.emit("add", call.constant(call.attr("bias", 1.0), like=x),
                     call.emit("mul", call.constant(call.attr("alpha", 1e-4), like=x), window))
    denominator = call.emit("pow", base, call.constant(call.attr("beta", 0.75), like=x))
    return call.emit("div", x, call.emit("reshape", denominator, shape=(-1, *shape[1:])))


# --- pooling


def _pool_geometry(call: NodeCall, size: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """kernel, stride, dilation, begin and end padding, and ceil_mode's extra end padding (a last window starting
    inside the end padding is dropped, as ONNX Runtime and torch do)."""
    nd = len(size)
    kernel = tuple(call.required("kernel_shape"))
    stride, dilation = _ints(call, "strides", nd, 1), _ints(call, "dilations", nd, 1)
    begin, end = _sides(call, size, kernel, stride, dilation)
    extra = [0] * nd
    if call.attr("ceil_mode", 0):
        for i, (n, k, s, d) in enumerate(zip(size, kernel, stride, dilation)):
            span, padded = window_span(k, d), n + begin[i] + end[i]
            out = -(-(padded - span) // s) + 1
            if (out - 1) * s >= n + begin[i]:
                out -= 1
            extra[i] = max((out - 1) * s + span - padded, 0)
    return kernel, stride, dilation, tuple(begin), tuple(end), tuple(extra)


def _pool(call: NodeCall, make) -> tuple[Value, ...]:
    """Run `make(x, kernel, stride, dilation, begin, end, extra)` (its results) on 4-D or 5-D input, 1-D pools as
    2-D ones through a unit dim."""
    x = call.input(0)
    size = _spatial(call, x)
    geometry = _pool_geometry(call, size)
    if len(size) == 1:
        unit = ((1 if i < 3 else 0, *g) for i, g in enumerate(geometry))  # kernel 1, stride 1, dilation 1, no pads
        return tuple(_drop_unit_dim(call, y) for y in make(_unit_dim(call, x), *unit))
    return make(x, *geometry)


def _symmetric(kernel, dilation, begin, end) -> bool:
    """Whether kiln's pools take this padding as is: equal sides, at most half the kernel span."""
    return begin == end and all(2 * p <= d * (k - 1) + 1 for p, k, d in zip(begin, kernel, dilation))


@converts("MaxPool", since=1)
def _max_pool(call: NodeCall) -> Sequence[Value]:
    """Window maxima; the Indices output (opset 8+) where the node names it."""
    with_indices = len(call.node.output) > 1 and bool(call.node.output[1])
    storage_order = call.attr("storage_order", 0)

    def make(x, kernel, stride, dilation, begin, end, extra):
        end = tuple(e + x for e, x in zip(end, extra))
        indices = (_argmax_indices(call, x, kernel, stride, dilation, begin, end, storage_order),) if with_indices \
            else ()
        if not _symmetric(kernel, dilation, begin, end):
            x, begin = _pad(call, x, begin, end, -math.inf), (0,) * len(begin)
        y = call.emit(f"max_pool{len(kernel)}d", x, kernel=kernel, stride=stride, padding=begin, dilation=dilation)
        return (y, *indices)
    x = call.input(0)
    if x.type.dtype.is_float:
        return _pool(call, make)
    if x.type.dtype not in _EXACT_IN_F32:
        raise Unsupported(f"max pooling {x.type.dtype.value}; kiln pools floats and the integers f32 holds exactly")
    # their max is the max of their exact f32 copies (ONNX's pads are under the kernel: no window is all padding)
    call = replace(call, inputs=[call.emit("cast", x, dtype=DType.f32)])
    y, *indices = _pool(call, make)
    return (call.emit("cast", y, dtype=x.type.dtype), *indices)


def _argmax_indices(call: NodeCall, x: Value, kernel: Sequence[int], stride: Sequence[int],
                    dilation: Sequence[int], begin: Sequence[int], end: Sequence[int], storage_order: int) -> Value:
    """MaxPool's Indices: each window's first maximum in kernel row-major order, as an index into x flattened
    ((n * C + c) * spatial size + the spatial position, row-major, or column-major under storage_order = 1).
    The windows of every kernel offset are stacked on a new last axis and argmax picks the offset; the index is
    then a compile-time table of that offset plus one of the window's start plus the (n, c) base."""
    nd, (n, c, *size) = len(kernel), x.type.shape
    if c is None:
        raise Unsupported(f"the Indices output of a dynamic channel count ({x.type})")
    padded = _pad(call, x, begin, end, -math.inf)
    out = [window_positions(p, k, st, d) for p, k, st, d in zip(padded.type.shape[2:], kernel, stride, dilation)]
    axes, offsets, windows = tuple(range(2, 2 + nd)), list(np.ndindex(*kernel)), []
    for t in offsets:
        starts = tuple(k * d for k, d in zip(t, dilation))
        w = call.emit("slice", padded, starts=starts, ends=tuple(s + (o - 1) * st + 1 for s, o, st in
                                                                  zip(starts, out, stride)),
                      axes=axes, steps=tuple(stride))
        windows.append(call.emit("reshape", w, shape=(-1, *w.type.shape[1:], 1)))
    stacked = windows[0] if len(windows) == 1 else call.emit("concat", *windows, axis=2 + nd)
    chosen = call.emit("argmax", stacked, axis=2 + nd)
    step = [math.prod(size[i + 1:]) if not storage_order else math.prod(size[:i]) for i in range(nd)]
    table = np.asarray([sum(k * d * m for k, d, m in zip(t, dilation, step)) for t in offsets], np.int64)
    starts = sum((np.indices(out)[i] * stride[i] - begin[i]) * step[i] for i in range(nd)).astype(np.int64)
    spatial = math.prod(size)
    index = call.emit("add", call.emit("take", call.constant(table), chosen), call.constant(starts))
    channel = (np.arange(c, dtype=np.int64) * spatial).reshape(c, *(1,) * nd)
    index = call.emit("add", index, call.constant(channel))
    if n == 1:
        return index
    first = call.emit("slice", chosen, starts=(0,) * (nd + 1), ends=(1,) * (nd + 1), axes=tuple(range(1, 2 + nd)))
    ones = call.emit("add", call.emit("mul", first, call.constant(np.int64(0))), call.constant(np.int64(1)))
    batch = call.emit("cumsum", ones, axis=0, exclusive=True)  # n, also for a dynamic batch
    return call.emit("add", index, call.emit("mul", batch, call.constant(np.int64(c * spatial))))


_EXACT_IN_F32 = (DType.i8, DType.u8, DType.i16)


def _counts(kernel: int, stride: int, dilation: int, out: int, lo: int, hi: int) -> np.ndarray:
    """How many of each window's kernel positions (window o starting at o * stride) fall inside [lo, hi)."""
    at = np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] * dilation
    return ((at >= lo) & (at < hi)).sum(axis=1)


@converts("AveragePool", since=1)
def _avg_pool(call: NodeCall) -> Value:
    """Mean over each window: kiln's avg pool where it takes the padding; else a sum over the padded input
    divided by a compile-time count of the elements ONNX counts (real ones, or under count_include_pad real and
    padding ones, never ceil_mode's)."""
    include = bool(call.attr("count_include_pad", 0))

    def make(x, kernel, stride, dilation, begin, end, extra):
        kind = f"avg_pool{len(kernel)}d"
        if _symmetric(kernel, dilation, begin, end) and not any(extra):
            return (call.emit(kind, x, kernel=kernel, stride=stride, padding=begin, dilation=dilation,
                              count_include_pad=include),)
        padded = _pad(call, x, begin, tuple(e + x for e, x in zip(end, extra)))
        y = call.emit(kind, padded, kernel=kernel, stride=stride, dilation=dilation)
        counts = [_counts(k, s, d, o, 0 if include else b, b + n + (e if include else 0))
                  for n, k, s, d, o, b, e in zip(x.type.shape[2:], kernel, stride, dilation, y.type.shape[2:], begin,
                                                 end)]
        factor = math.prod(kernel) / functools.reduce(np.multiply.outer, counts)
        return (call.emit("mul", y, call.constant(factor.astype(x.type.dtype.numpy))),)
    return _pool(call, make)[0]


@converts("GlobalAveragePool", "GlobalMaxPool", since=1)
def _global_pool(call: NodeCall) -> Value:
    x = call.input(0)
    kind = "mean" if call.node.op_type == "GlobalAveragePool" else "max"
    return call.emit(kind, x, axes=tuple(range(2, x.type.rank)), keepdims=True)


# --- depth and space


@converts("DepthToSpace", since=1)
def _depth_to_space(call: NodeCall) -> Value:
    """[N, C, H, W] -> [N, C / b^2, H * b, W * b]: channels read as (b, b, C / b^2) in DCR mode, (C / b^2, b, b)
    in CRD mode."""
    x, b = call.input(0), call.required("blocksize")
    n, c, h, w = _static_nchw(x)
    if call.attr("mode", "DCR") == "DCR":
        y = call.emit("reshape", x, shape=(-1, b, b, c // (b * b), h, w))
        y = call.emit("transpose", y, perm=(0, 3, 4, 1, 5, 2))
    else:
        y = call.emit("reshape", x, shape=(-1, c // (b * b), b, b, h, w))
        y = call.emit("transpose", y, perm=(0, 1, 4, 2, 5, 3))
    return call.emit("reshape", y, shape=(-1, c // (b * b), h * b, w * b))


@converts("SpaceToDepth", since=1)
def _space_to_depth(call: NodeCall) -> Value:
    """[N, C, H, W] -> [N, C * b^2, H / b, W / b]: the block offsets lead the channels in DCR mode, follow them
    in CRD mode (the inverses of DepthToSpace's)."""
    x, b = call.input(0), call.required("blocksize")
    n, c, h, w = _static_nchw(x)
    if h % b or w % b:
        raise Unsupported(f"blocksize {b} does not divide the spatial dims of {x.type}")
    y = call.emit("reshape", x, shape=(-1, c, h // b, b, w // b, b))
    y = call.emit("transpose", y, perm=(0, 3, 5, 1, 2, 4) if call.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4))
    return call.emit("reshape", y, shape=(-1, c * b * b, h // b, w // b))


def _static_nchw(x: Value) -> tuple:
    if x.type.rank != 4 or any(d is None for d in x.type.shape[1:]):
        raise Unsupported(f"input {x.type} is not [N, C, H, W] with static C, H and W")
    return x.type.shape


# --- pad


@converts("Pad", since=2)
def _pad_op(call: NodeCall) -> Value:
    """Pads as an attribute before opset 11, as inputs (pads, constant_value, and from 18 axes) after."""
    x = call.input(0)
    mode = call.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise Unsupported(f"mode = {mode!r}")
    if call.opset < 11:
        pads, value = list(call.required("pads")), float(call.attr("value", 0.0))
    else:
        given = call.value(1, "the pads")
        if given is None:
            raise Unsupported("the pads input is missing")
        pads = [int(p) for p in given]
        constant = call.value(2, "the constant value")
        value = 0.0 if constant is None else float(np.asarray(constant).reshape(()))
    rank = x.type.rank
    axes = call.value(3, "the axes") if call.opset >= 18 else None
    axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
    if len(pads) != 2 * len(axes):
        raise Unsupported(f"pads = {pads} does not hold two values per padded axis ({len(axes)})")
    before, after = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        before[a], after[a] = pads[i], pads[len(axes) + i]
    if mode == "wrap":
        return _wrap(call, x, before, after)
    return call.emit("pad", x, before=tuple(before), after=tuple(after), mode=mode, value=value)


def _wrap(call: NodeCall, x: Value, before: Sequence[int], after: Sequence[int]) -> Value:
    """Wrap padding: each padded axis continues periodically, its last `before` items ahead of it and its first
    `after` ones behind (pads from 0 to the axis's static size)."""
    for axis, (b, e) in enumerate(zip(before, after)):
        size = x.type.shape[axis]
        if not (b or e):
            continue
        if size is None or not (0 <= b <= size and 0 <= e <= size):
            raise Unsupported(f"wrap pads {b}, {e} on axis {axis} of {x.type}: kiln wraps 0 to the axis size")
        parts = [call.emit("slice", x, starts=(size - b,), ends=(size,), axes=(axis,))] if b else []
        parts.append(x)
        if e:
            parts.append(call.emit("slice", x, starts=(0,), ends=(e,), axes=(axis,)))
        x = call.emit("concat", *parts, axis=axis)
    return x
