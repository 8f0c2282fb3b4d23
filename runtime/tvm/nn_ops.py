"""Relax lowerings of kiln's neural-network ops: convolution (plain and transposed), pooling, layer/RMS/batch
normalization."""

from __future__ import annotations

import math

from tvm import relax, te, tirx
from tvm.relax import op as R

from kiln.ir.ops.common import norm_axes

from .lowp import conv_operands
from .rule import OpCall, RelaxResult, relax_rule


def _per_channel(call: OpCall, v: relax.Expr) -> relax.Expr:
    """A [C] vector shaped [C, 1, ...] to broadcast over the channel axis of operand 0 (NC...)."""
    return R.reshape(call.emit(v), [-1, *(1,) * (call.types[0].rank - 2)])


_CONV = {"conv1d": R.nn.conv1d, "conv2d": R.nn.conv2d, "conv3d": R.nn.conv3d}
_CONV_TRANSPOSE = {"conv_transpose1d": R.nn.conv1d_transpose, "conv_transpose2d": R.nn.conv2d_transpose,
                   "conv_transpose3d": R.nn.conv3d_transpose}
_MAX_POOL = {"max_pool2d": R.nn.max_pool2d, "max_pool3d": R.nn.max_pool3d}
_AVG_POOL = {"avg_pool2d": R.nn.avg_pool2d, "avg_pool3d": R.nn.avg_pool3d}


@relax_rule(*_CONV)
def _conv(call: OpCall) -> RelaxResult:
    """The convolution, with bf16 operands and f32 sums under precision bf16 (`lowp.conv_operands`)."""
    conv = _CONV[call.kind]
    a = call.attrs
    (x, w), out = conv_operands(call)
    y = conv(x, w, a["stride"], a["padding"], a["dilation"], a["groups"], out_dtype=out)
    return y if len(call.args) == 2 else R.add(y, _per_channel(call, call.args[2]))


@relax_rule(*_CONV_TRANSPOSE)
def _conv_transpose(call: OpCall) -> RelaxResult:
    conv = _CONV_TRANSPOSE[call.kind]
    a = call.attrs
    y = conv(call.args[0], call.args[1], a["stride"], a["padding"], a["output_padding"], a["dilation"], a["groups"])
    return y if len(call.args) == 2 else R.add(y, _per_channel(call, call.args[2]))


@relax_rule(*_MAX_POOL)
def _max_pool(call: OpCall) -> RelaxResult:
    a = call.attrs
    return _MAX_POOL[call.kind](call.args[0], a["kernel"], a["stride"] or a["kernel"], a["padding"], a["dilation"])


@relax_rule(*_AVG_POOL)
def _avg_pool(call: OpCall) -> RelaxResult:
    a = call.attrs
    return _AVG_POOL[call.kind](call.args[0], a["kernel"], a["stride"] or a["kernel"], a["padding"], a["dilation"],
                                count_include_pad=a["count_include_pad"])


@relax_rule("adaptive_avg_pool2d")
def _adaptive_avg_pool(call: OpCall) -> RelaxResult:
    return R.nn.adaptive_avg_pool2d(call.args[0], call.attrs["output_size"])


def _affine_operands(call: OpCall, count: int) -> tuple[list[int], list[relax.Expr]]:
    """The normalized axes and gamma (and beta), with ones (and zeros) standing in for absent ones."""
    axes = list(norm_axes(call.kind, call.attrs["axes"], call.types[0].rank))
    shape = [call.shape(0)[a] for a in axes]
    fills = [R.ones(shape, call.dtype()), R.zeros(shape, call.dtype())][:count]
    return axes, [call.args[1 + i] if len(call.args) > 1 + i else fill for i, fill in enumerate(fills)]


@relax_rule("layer_norm")
def _layer_norm(call: OpCall) -> RelaxResult:
    axes, (gamma, beta) = _affine_operands(call, 2)
    return R.nn.layer_norm(call.args[0], gamma, beta, axes, call.attrs["eps"])


@relax_rule("rms_norm")
def _rms_norm(call: OpCall) -> RelaxResult:
    axes, (gamma,) = _affine_operands(call, 1)
    return R.nn.rms_norm(call.args[0], gamma, axes, call.attrs["eps"])


def _bessel(call: OpCall, n: tirx.PrimExpr) -> relax.Expr:
    """n / (n - 1) as a scalar of the operand dtype; a symbolic count is read from the shape at run time."""
    dtype = call.dtype()
    if isinstance(n, tirx.IntImm):
        return relax.const(n.value / (n.value - 1), dtype)
    return call.bb.call_te(lambda count: te.compute((), lambda: count.astype(dtype) / (count - 1).astype(dtype),
                                                    name="bessel"), n, primfunc_name_hint="bessel")


def _batch_statistics(call: OpCall) -> tuple[relax.Expr, relax.Expr, relax.Expr, relax.Expr]:
    """Batch mean and biased variance over all axes but 1, and the running stats updated with the unbiased
    variance, as torch updates them."""
    x, running_mean, running_var, dtype = call.args[0], call.args[3], call.args[4], call.dtype()
    axes = [0, *range(2, call.types[0].rank)]
    mean = call.emit(R.mean(x, axes))
    centered = call.emit(R.subtract(x, _per_channel(call, mean)))
    var = call.emit(R.mean(R.multiply(centered, centered), axes))
    momentum, keep = relax.const(call.attrs["momentum"], dtype), relax.const(1 - call.attrs["momentum"], dtype)
    count = math.prod((call.shape(0)[a] for a in axes), start=tirx.const(1, "int64"))
    unbiased = R.multiply(var, _bessel(call, count))
    new_mean = R.add(R.multiply(keep, running_mean), R.multiply(momentum, mean))
    new_var = R.add(R.multiply(keep, running_var), R.multiply(momentum, unbiased))
    return mean, var, call.emit(new_mean), call.emit(new_var)


def _normalize(call: OpCall, mean: relax.Expr, var: relax.Expr) -> relax.Expr:
    """(x - mean) * gamma / sqrt(var + eps) + beta, per channel."""
    x, gamma, beta = call.args[:3]
    scale = R.multiply(gamma, R.rsqrt(R.add(var, relax.const(call.attrs["eps"], call.dtype()))))
    centered = R.subtract(x, _per_channel(call, mean))
    return R.add(R.multiply(call.emit(centered), _per_channel(call, scale)), _per_channel(call, beta))


@relax_rule("batch_norm")
def _batch_norm(call: OpCall) -> RelaxResult:
    """y from the batch statistics while training (results 2 and 3 the updated running stats), else from the
    running statistics, returned unchanged. A flag known only at run time selects between the two."""
    training, running_mean, running_var = call.flag(5), call.args[3], call.args[4]
    if training is False:
        return _normalize(call, running_mean, running_var), running_mean, running_var
    mean, var, new_mean, new_var = _batch_statistics(call)
    trained = (_normalize(call, mean, var), new_mean, new_var)
    if training:
        return trained
    valid = (_normalize(call, running_mean, running_var), running_mean, running_var)
    return tuple(R.where(call.args[5], call.emit(t), call.emit(v)) for t, v in zip(trained, valid))
