"""Depthwise convs of NCHW maps computed plane by plane: a Relax rewrite before legalization, and its kernel.

A depthwise conv left in NCHW (its input is not blocked: a lone conv, a network's first layer) ran as TVM's
grouped conv, its zero padding a whole extra copy of the map, with vectors along rows that 28-, 14- and 7-wide
maps fill badly: 1.5-1.8x onnxruntime on one core. Here each channel's padded plane is a small scratch of the
kernel (`PAD_BLOCK`, in L1), its rows as wide as a whole number of vectors and, for a stride s, stored phase by
phase (`x'[i, w % s, w // s]`) so every window tap reads a contiguous vector; the sums (`ACC_BLOCK`) are as wide,
and only the real columns are stored (`OUT_BLOCK`). `schedules/plane_depthwise.py` schedules it.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from .cpu import cpu_model
from .relax_rewrite import rewrite_functions, static_f32_shape

PAD_BLOCK, ACC_BLOCK, OUT_BLOCK = "depthwise_plane_pad", "depthwise_plane_sum", "depthwise_plane"
_CONV2D = tvm.ir.Op.get("relax.nn.conv2d")


def vector_width(columns: int, lanes: int) -> int:
    """Lanes of the vectors a row of `columns` outputs is computed in: the narrowest power of two up to `lanes` that
    needs no more vectors than `lanes` do (a 7-wide row in one 8-lane vector on AVX-512, not a 16-lane one)."""
    vectors = -(-columns // lanes)
    width = lanes
    while width > 1 and -(-columns // (width // 2)) == vectors:
        width //= 2
    return width


def plane_depthwise(x: te.Tensor, w: te.Tensor, strides: list[int], padding: list[int], dilation: list[int],
                    lanes: int) -> te.Tensor:
    """`y[n, c, i, j] = sum(x[n, c, i * sh + ry * dh - top, j * sw + rx * dw - left] * w[c, 0, ry, rx])` (zero outside
    the map), through a per-channel padded plane and sums over rows padded to whole vectors of `vector_width`."""
    n, c, h, width = (int(d) for d in x.shape)
    kh, kw = (int(d) for d in w.shape[2:])
    (sh, sw), (dh, dw), (top, left, bottom, right) = strides, dilation, padding
    oh = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
    ow = (width + left + right - dw * (kw - 1) - 1) // sw + 1
    owv = -(-ow // vector_width(ow, lanes)) * vector_width(ow, lanes)
    rows, phase_width = (oh - 1) * sh + dh * (kh - 1) + 1, owv + dw * (kw - 1) // sw

    def padded(b: tirx.Var, ch: tirx.Var, i: tirx.Var, phase: tirx.Var, q: tirx.Var) -> tirx.Expr:
        row, col = i - top, q * sw + phase - left
        inside = tirx.all(row >= 0, row < h, col >= 0, col < width)
        return tirx.if_then_else(inside, x[b, ch, row, col], tirx.const(0, x.dtype))

    xp = te.compute((n, c, rows, sw, phase_width), padded, name=PAD_BLOCK)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    sums = te.compute((n, c, oh, owv), lambda b, ch, i, j: te.sum(
        xp[b, ch, i * sh + ry * dh, rx * dw % sw, j + rx * dw // sw] * w[ch, 0, ry, rx], axis=[ry, rx]),
        name=ACC_BLOCK)
    return te.compute((n, c, oh, ow), lambda b, ch, i, j: sums[b, ch, i, j], name=OUT_BLOCK)


def is_plane_depthwise(call: relax.Call) -> bool:
    """Whether `call` is a static, non-empty float32 NCHW conv2d with one filter per channel (`groups` = in = out
    channels)."""
    if call.op != _CONV2D:
        return False
    a = call.attrs
    x, w, out = (static_f32_shape(t) for t in (call.args[0].ty, call.args[1].ty, call.ty))
    return (x is not None and w is not None and out is not None and len(x) == 4 and min(x + w + out) > 0
            and (a.data_layout, a.kernel_layout, a.out_layout) == ("NCHW", "OIHW", "NCHW")
            and int(a.groups) == x[1] == out[1] == w[0] and w[1] == 1)


@mutator
class _Planes(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, lanes: int) -> None:
        super().__init__(mod)
        self.lanes = lanes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_plane_depthwise(call):
            return call
        a = call.attrs
        ints = [[int(v) for v in vs] for vs in (a.strides, a.padding, a.dilation)]
        return self.builder_.call_te(plane_depthwise, call.args[0], call.args[1], *ints, self.lanes,
                                     primfunc_name_hint=OUT_BLOCK)


def plane_depthwise_convs(target: Target) -> tvm.transform.Pass:
    """The module pass computing every NCHW depthwise conv left (after `block_conv_regions`) plane by plane."""
    lanes = cpu_model(target).lanes()

    @tvm.transform.module_pass(opt_level=0, name="KilnPlaneDepthwise")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _Planes(mod, lanes))

    return _pass
