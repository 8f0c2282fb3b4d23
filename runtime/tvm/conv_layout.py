"""Conv2d with output channels in blocks of one vector (NCHW[x]c inside the kernel): a Relax rewrite before
legalization, which the CPU model decides per conv and which packs a bound weight once, at build time.

A 3x3 conv whose output width fills its vector tiles badly (28 = 14 + 14 columns, 8 + 6 lanes each; 14) ran at a
third of onnxruntime's speed. Computed as `y[n, o // b, h, w, o % b]` with the weight stored
`[O / b, I, KH, KW, b]` (b = vector lanes, zero rows past O), `CPUMatmul` vectorizes over output channels and
tiles output columns as its rows, reading one contiguous weight vector per reduction step; the result goes back to
NCHW in the same kernel. A weight that is a constant (`params="bound"`) is packed here, in numpy; any other
weight (`params="inputs"`) gets the packing as a kernel of the program.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from .cpu import cpu_model
from .schedules.matmul import CPUMatmul

BLOCKED_NAME = "conv2d_nchw_blocked"  # the PrimFunc name hint of a blocked conv (its block is `conv_blocked`)
_CONV2D = tvm.ir.Op.get("relax.nn.conv2d")


def _static(shape: relax.Expr) -> list[int] | None:
    dims = getattr(shape, "values", None)
    return [int(d) for d in dims] if dims is not None and all(isinstance(d, tirx.IntImm) for d in dims) else None


def lanes_filled(extent: int, tile: int, lanes: int) -> float:
    """The fraction of vector lanes doing work when `extent` elements go in tiles of `tile` (in whole vectors)."""
    return extent / (-(-extent // tile) * -(-tile // lanes) * lanes)


def blocks_output_channels(out_channels: int, out_width: int, rule: CPUMatmul) -> bool:
    """Whether vectors over output channels fill more lanes than vectors along the output width, as `rule` (a
    `CPUMatmul` sized `for_cpu`) tiles it. A map narrower than one vector stays NCHW: the rule tiles it several
    output rows at a time, while blocked its few columns leave a ragged row tile (7-wide maps ran 1.1-1.7x slower)."""
    lanes = rule.lanes or 1
    if out_width < lanes:
        return False
    width = lanes_filled(out_width, rule.vector_tile(tirx.IntImm("int32", out_width)), lanes)
    return lanes_filled(out_channels, lanes, lanes) > width


def pack_weight(w: np.ndarray, block: int) -> np.ndarray:
    """`[O, I, KH, KW]` as `[ceil(O / block), I, KH, KW, block]`, zero past O."""
    o = w.shape[0]
    padded = np.zeros((-(-o // block) * block, *w.shape[1:]), w.dtype)
    padded[:o] = w
    return np.ascontiguousarray(padded.reshape(-1, block, *w.shape[1:]).transpose(0, 2, 3, 4, 1))


def _pack_te(w: te.Tensor, block: int) -> te.Tensor:
    o, i, kh, kw = (int(d) for d in w.shape)
    return te.compute((-(-o // block), i, kh, kw, block), lambda ob, c, y, x, v: tirx.if_then_else(
        ob * block + v < o, w[tirx.min(ob * block + v, o - 1), c, y, x], tirx.const(0, w.dtype)), name="pack")


def _blocked_conv(x: te.Tensor, wp: te.Tensor, out_channels: int, strides: list[int], padding: list[int],
                  dilation: list[int]) -> te.Tensor:
    """NCHW in and out, the sums over blocks of `wp.shape[-1]` output channels."""
    n, c, h, w = (int(d) for d in x.shape)
    _, _, kh, kw, block = (int(d) for d in wp.shape)
    top, left, bottom, right = padding
    xp = topi.nn.pad(x, [0, 0, top, left], [0, 0, bottom, right]) if any(padding) else x
    oh = (h + top + bottom - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (w + left + right - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    rc, ry, rx = te.reduce_axis((0, c), "rc"), te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    y = te.compute((n, wp.shape[0], oh, ow, block), lambda b, o, i, j, v: te.sum(
        xp[b, rc, i * strides[0] + ry * dilation[0], j * strides[1] + rx * dilation[1]] * wp[o, rc, ry, rx, v],
        axis=[rc, ry, rx]), name="conv_blocked")
    return te.compute((n, out_channels, oh, ow), lambda b, o, i, j: y[b, o // block, i, j, o % block], name="unblock")


@mutator
class _Blocker(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, rule: CPUMatmul) -> None:
        super().__init__(mod)
        self.rule = rule

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _CONV2D:
            return call
        a = call.attrs
        x_shape, w_shape = (_static(arg.ty.shape) for arg in call.args)
        out = _static(call.ty.shape)
        plain = (a.data_layout, a.kernel_layout, a.out_layout) == ("NCHW", "OIHW", "NCHW") and int(a.groups) == 1
        f32 = all(arg.ty.dtype == "float32" for arg in call.args) and call.ty.dtype == "float32"
        if not (plain and f32 and x_shape and w_shape and out
                and blocks_output_channels(out[1], out[3], self.rule)):
            return call
        block, w = self.rule.lanes, call.args[1]
        if isinstance(w, tvm.ir.Constant):
            wp: relax.Expr = relax.const(pack_weight(w.value.numpy(), block))
        else:
            wp = self.builder_.emit(self.builder_.call_te(_pack_te, w, block, primfunc_name_hint="pack_conv_weight"))
        ints = [[int(v) for v in vs] for vs in (a.strides, a.padding, a.dilation)]
        return self.builder_.call_te(_blocked_conv, call.args[0], wp, out[1], *ints, primfunc_name_hint=BLOCKED_NAME)


def block_conv_channels(target: Target) -> tvm.transform.Pass:
    """The module pass rewriting the convs `blocks_output_channels` picks for `target`'s CPU."""
    rule = CPUMatmul().for_cpu(cpu_model(target))

    @tvm.transform.module_pass(opt_level=0, name="KilnBlockConvChannels")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        blocker = _Blocker(mod, rule)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                blocker.builder_.update_func(gvar, blocker.visit_expr(func))
        return blocker.builder_.get()

    return _pass
