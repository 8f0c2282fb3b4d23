"""Depthwise convs and max/avg pools of NCHW maps computed plane by plane: a Relax rewrite before legalization, and
its kernels.

A depthwise conv left in NCHW (its input is not blocked: a lone conv, a network's first layer) ran as TVM's
grouped conv, its zero padding a whole extra copy of the map, with vectors along rows that 28-, 14- and 7-wide
maps fill badly: 1.5-1.8x onnxruntime on one core; a 3x3/2 pool, its vectors strided gathers, 4x. Here each
channel's padded plane is a small scratch of the kernel (`PAD_BLOCK`, in L1), its rows as wide as a whole number
of vectors and, for a stride s, stored phase by phase (`x'[i, w % s, w // s]`) so every window tap reads a
contiguous vector; the window's sums (or maxima: `ACC_BLOCK`) are as wide, and only the real columns are stored
(`OUT_BLOCK`). `schedules/plane_window.py` schedules them.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from .cpu import cpu_model
from .relax_rewrite import batched_f32_shape, depthwise_conv, int_lists, rewrite_functions

PAD_BLOCK, ACC_BLOCK, OUT_BLOCK = "plane_window_pad", "plane_window_acc", "plane_window"
_POOLS = {tvm.ir.Op.get(f"relax.nn.{kind}_pool2d"): kind for kind in ("max", "avg")}

Tap = Callable[[tirx.Var, tirx.Var, tirx.Var, tirx.Var, tirx.Var, tirx.Var], tirx.Expr]


def vector_width(columns: int, lanes: int) -> int:
    """Lanes of the vectors a row of `columns` outputs is computed in: the narrowest power of two up to `lanes` that
    needs no more vectors than `lanes` do (a 7-wide row in one 8-lane vector on AVX-512, not a 16-lane one)."""
    vectors = -(-columns // lanes)
    width = lanes
    while width > 1 and -(-columns // (width // 2)) == vectors:
        width //= 2
    return width


def _out_size(size: int, before: int, after: int, kernel: int, stride: int, dilation: int) -> int:
    return (size + before + after - dilation * (kernel - 1) - 1) // stride + 1


def _plane(x: te.Tensor, kernel: tuple[int, int], strides: list[int], padding: list[int], dilation: list[int],
           lanes: int, fill: tirx.Expr) -> tuple[Tap, int, int, int]:
    """(the window's tap `(b, c, i, j, ry, rx) -> x'[..]` of the padded, phase-split plane; out rows; out columns;
    columns rounded up to whole vectors). Outside the map the plane holds `fill`."""
    c, h, width = (int(d) for d in x.shape[1:])
    (kh, kw), (sh, sw), (dh, dw), (top, left, bottom, right) = kernel, strides, dilation, padding
    oh, ow = _out_size(h, top, bottom, kh, sh, dh), _out_size(width, left, right, kw, sw, dw)
    owv = -(-ow // vector_width(ow, lanes)) * vector_width(ow, lanes)
    rows, phase_width = (oh - 1) * sh + dh * (kh - 1) + 1, owv + dw * (kw - 1) // sw

    def padded(b: tirx.Var, ch: tirx.Var, i: tirx.Var, phase: tirx.Var, q: tirx.Var) -> tirx.Expr:
        row, col = i - top, q * sw + phase - left
        return tirx.if_then_else(tirx.all(row >= 0, row < h, col >= 0, col < width), x[b, ch, row, col], fill)

    xp = te.compute((x.shape[0], c, rows, sw, phase_width), padded, name=PAD_BLOCK)
    return (lambda b, ch, i, j, ry, rx: xp[b, ch, i * sh + ry * dh, rx * dw % sw, j + rx * dw // sw]), oh, ow, owv


def _crop(acc: te.Tensor, oh: int, ow: int, scale: Callable[[tirx.Var, tirx.Var], tirx.Expr] | None = None
          ) -> te.Tensor:
    n, c = acc.shape[:2]
    return te.compute((n, c, oh, ow), lambda b, ch, i, j: acc[b, ch, i, j] if scale is None else
                      acc[b, ch, i, j] * scale(i, j), name=OUT_BLOCK)


def plane_depthwise(x: te.Tensor, w: te.Tensor, strides: list[int], padding: list[int], dilation: list[int],
                    lanes: int) -> te.Tensor:
    """`y[n, c, i, j] = sum(x[n, c, i * sh + ry * dh - top, j * sw + rx * dw - left] * w[c, 0, ry, rx])`, zero
    outside the map."""
    kh, kw = (int(d) for d in w.shape[2:])
    tap, oh, ow, owv = _plane(x, (kh, kw), strides, padding, dilation, lanes, tirx.const(0, x.dtype))
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    acc = te.compute((*x.shape[:2], oh, owv), lambda b, ch, i, j: te.sum(
        tap(b, ch, i, j, ry, rx) * w[ch, 0, ry, rx], axis=[ry, rx]), name=ACC_BLOCK)
    return _crop(acc, oh, ow)


def _inside(index: tirx.Var, taps: int, stride: int, before: int, dilation: int, size: int) -> tirx.Expr:
    """How many of the window's `taps` along one axis fall inside the map, for output `index`."""
    start = index * stride - before
    return sum((tirx.Select(tirx.all(start + t * dilation >= 0, start + t * dilation < size), 1, 0)
                for t in range(taps)), tirx.const(0, "int32"))


def plane_pool(x: te.Tensor, kind: str, kernel: list[int], strides: list[int], padding: list[int],
               dilation: list[int], count_include_pad: bool, lanes: int) -> te.Tensor:
    """Max or average pooling (`kind`) as `relax.nn.{kind}_pool2d` computes it without `ceil_mode`: the maximum
    over the map's elements of each window, or their sum over the window's size (`count_include_pad`) or over the
    elements of the window inside the map."""
    kh, kw = kernel
    fill = tirx.min_value(x.dtype) if kind == "max" else tirx.const(0, x.dtype)
    tap, oh, ow, owv = _plane(x, (kh, kw), strides, padding, dilation, lanes, fill)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    combine = te.max if kind == "max" else te.sum
    acc = te.compute((*x.shape[:2], oh, owv), lambda b, ch, i, j: combine(tap(b, ch, i, j, ry, rx), axis=[ry, rx]),
                     name=ACC_BLOCK)
    if kind == "max":
        return _crop(acc, oh, ow)
    if count_include_pad:
        return _crop(acc, oh, ow, lambda i, j: tirx.const(1 / (kh * kw), x.dtype))
    (sh, sw), (dh, dw), (top, left, *_) = strides, dilation, padding
    h, width = (int(d) for d in x.shape[2:])
    return _crop(acc, oh, ow, lambda i, j: tirx.const(1, x.dtype) / tirx.Cast(x.dtype, _inside(
        i, kh, sh, top, dh, h) * _inside(j, kw, sw, left, dw, width)))


def _nchw(call: relax.Call) -> list | None:
    """The float32 shape of `call`'s first operand when it and the result are 4-D, non-empty and static but for the
    batch (`batched_f32_shape`: a dynamic batch only bounds the kernel's parallel loop over images and channels)."""
    x, out = batched_f32_shape(call.args[0].ty), batched_f32_shape(call.ty)
    return x if x is not None and out is not None and len(x) == len(out) == 4 and min(x[1:] + out[1:]) > 0 else None


def is_plane_depthwise(call: relax.Call) -> bool:
    """Whether `call` is a depthwise conv (`relax_rewrite.depthwise_conv`) of a non-empty map."""
    return depthwise_conv(call) and _nchw(call) is not None


def is_plane_pool(call: relax.Call) -> bool:
    """Whether `call` is a non-empty float32 NCHW max or average pool (`_nchw`) without `ceil_mode` whose windows
    overlap or pad the map. Disjoint windows (2x2/2) read every element once: the plane's copy (a scalar loop for
    a stride's phases) is all it would add, and the 2x2/2 pool of 8x64x56² took 2.7x as long as TVM's."""
    if call.op not in _POOLS or _nchw(call) is None:
        return False
    a = call.attrs
    overlap = any(int(d) * (int(k) - 1) + 1 > int(s) for k, s, d in zip(a.pool_size, a.strides, a.dilation))
    return (not a.ceil_mode and a.layout == a.out_layout == "NCHW"
            and (overlap or any(int(p) for p in a.padding)))


@mutator
class _Planes(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, lanes: int) -> None:
        super().__init__(mod)
        self.lanes = lanes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        a = call.attrs
        if is_plane_depthwise(call):
            ints = int_lists(a.strides, a.padding, a.dilation)
            return self.builder_.call_te(plane_depthwise, call.args[0], call.args[1], *ints, self.lanes,
                                         primfunc_name_hint="depthwise_plane")
        if is_plane_pool(call):
            ints = int_lists(a.pool_size, a.strides, a.padding, a.dilation)
            kind = _POOLS[call.op]
            return self.builder_.call_te(plane_pool, call.args[0], kind, *ints, bool(a.count_include_pad),
                                         self.lanes, primfunc_name_hint=f"{kind}_pool_plane")
        return call


def plane_windows(target: Target) -> tvm.transform.Pass:
    """The module pass computing every NCHW depthwise conv and pool left (after `block_conv_regions`) plane by
    plane."""
    lanes = cpu_model(target).lanes()

    @tvm.transform.module_pass(opt_level=0, name="KilnPlaneWindows")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _Planes(mod, lanes))

    return _pass
