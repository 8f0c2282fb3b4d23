"""ONNX lowerings of kiln's neural-network ops: convolution (plain and transposed), pooling, layer/RMS/batch
normalization."""

from __future__ import annotations

import numpy as np

from kiln.ir.ops.common import norm_axes

from .rule import OnnxCall, OnnxResult, onnx_rule


@onnx_rule("conv1d", "conv2d", "conv3d")
def _conv(call: OnnxCall) -> OnnxResult:
    a = call.attrs
    return call.node("Conv", *call.inputs, strides=a["stride"], pads=[*a["padding"], *a["padding"]],
                     dilations=a["dilation"], group=a["groups"])


@onnx_rule("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
def _conv_transpose(call: OnnxCall) -> OnnxResult:
    a = call.attrs
    return call.node("ConvTranspose", *call.inputs, strides=a["stride"], pads=[*a["padding"], *a["padding"]],
                     output_padding=a["output_padding"], dilations=a["dilation"], group=a["groups"])


@onnx_rule("max_pool2d", "max_pool3d")
def _max_pool(call: OnnxCall) -> OnnxResult:
    """MaxPool ignores its padding, as kiln's -inf padding never wins."""
    a = call.attrs
    return call.node("MaxPool", call.inputs[0], kernel_shape=a["kernel"], strides=a["stride"] or a["kernel"],
                     pads=[*a["padding"], *a["padding"]], dilations=a["dilation"])


@onnx_rule("avg_pool2d", "avg_pool3d")
def _avg_pool(call: OnnxCall) -> OnnxResult:
    a = call.attrs
    return call.node("AveragePool", call.inputs[0], kernel_shape=a["kernel"], strides=a["stride"] or a["kernel"],
                     pads=[*a["padding"], *a["padding"]], dilations=a["dilation"],
                     count_include_pad=int(a["count_include_pad"]))


def _bin(call: OnnxCall, n: int | str, i: int, out: int) -> tuple[str, str]:
    """Start and end ([1] int64 tensors) of torch's adaptive bin i of `out` over length n: [i*n//out, ceil)."""
    if isinstance(n, int):
        return call.ints([i * n // out]), call.ints([-(-(i + 1) * n // out)])

    def div(k: int, add: int) -> str:  # (n * k + add) // out, all non-negative
        scaled = call.node("Add", call.node("Mul", n, call.ints([k])), call.ints([add]))
        return call.node("Div", scaled, call.ints([out]))
    return div(i, 0), div(i + 1, out - 1)


@onnx_rule("adaptive_avg_pool2d")
def _adaptive_avg_pool(call: OnnxCall) -> OnnxResult:
    """Bin means along H, then W, as the reference computes them; a dynamic H or W finds its bins at run time."""
    y = call.inputs[0]
    for axis, out in zip((2, 3), call.attrs["output_size"]):
        n, at = call.dim(0, axis), call.ints([axis])
        means = [call.node("ReduceMean", call.node("Slice", y, *_bin(call, n, i, out), at), at, keepdims=1)
                 for i in range(out)]
        y = call.node("Concat", *means, axis=axis) if out > 1 else means[0]
    return y


def _spread(call: OnnxCall, name: str, axes: tuple[int, ...]) -> str:
    """An affine operand laid along the normalized axes of operand 0 (size-1 dims elsewhere)."""
    others = [a for a in range(call.types[0].rank) if a not in axes]
    return call.node("Unsqueeze", name, call.ints(others)) if others else name


def _affine(call: OnnxCall, y: str, axes: tuple[int, ...]) -> str:
    """y * gamma + beta for whichever of them the op has."""
    for op_type, operand in zip(("Mul", "Add"), call.inputs[1:]):
        y = call.node(op_type, y, _spread(call, operand, axes))
    return y


def _root_mean(call: OnnxCall, square: str, axes: tuple[int, ...]) -> str:
    """sqrt(mean(square over axes) + eps), kept for broadcasting."""
    mean = call.node("ReduceMean", square, call.ints(axes), keepdims=1)
    return call.node("Sqrt", call.node("Add", mean, call.scalar(call.attrs["eps"])))


@onnx_rule("layer_norm")
def _layer_norm(call: OnnxCall) -> OnnxResult:
    """LayerNormalization over trailing axes; other axes, or no gamma to give it over dynamic dims, decompose."""
    x, t = call.inputs[0], call.types[0]
    axes = norm_axes("layer_norm", call.attrs["axes"], t.rank)
    normalized = [t.shape[a] for a in axes]
    trailing = axes == tuple(range(axes[0], t.rank))
    if trailing and (len(call.inputs) > 1 or None not in normalized):
        gamma = call.inputs[1] if len(call.inputs) > 1 else call.const(np.ones(normalized, t.dtype.numpy))
        return call.node("LayerNormalization", x, gamma, *call.inputs[2:], axis=axes[0], epsilon=call.attrs["eps"])
    centered = call.node("Sub", x, call.node("ReduceMean", x, call.ints(axes), keepdims=1))
    y = call.node("Div", centered, _root_mean(call, call.node("Mul", centered, centered), axes))
    return _affine(call, y, axes)


@onnx_rule("rms_norm")
def _rms_norm(call: OnnxCall) -> OnnxResult:
    x = call.inputs[0]
    axes = norm_axes("rms_norm", call.attrs["axes"], call.types[0].rank)
    return _affine(call, call.node("Div", x, _root_mean(call, call.node("Mul", x, x), axes)), axes)


@onnx_rule("batch_norm")
def _batch_norm(call: OnnxCall) -> OnnxResult:
    """Inference BatchNormalization on the running statistics, which it returns unchanged.

    Valid-mode canonicalization already turns batch norm over a static channel dim into an affine op; batch
    statistics (a training flag not known to be false) update running state, which an exported model has not.
    """
    if call.flag(5) is not False:
        raise call.unsupported("its training flag is not known to be false, and the batch statistics it would "
                               "use update running state; export a module in valid mode")
    x, gamma, beta, mean, var = call.inputs[:5]
    return call.node("BatchNormalization", x, gamma, beta, mean, var, epsilon=call.attrs["eps"]), mean, var
