"""Depthwise convs of NCHW maps computed plane by plane: a Relax rewrite before legalization, and its kernel.

A depthwise conv left in NCHW (its input is not blocked: a lone conv, a network's first layer) ran as TVM's
grouped conv, its zero padding a whole extra copy of the map, with vectors along rows that 28-, 14- and 7-wide
maps fill badly: 1.5-1.8x onnxruntime on one core. Here each channel's padded plane is a small scratch of the
kernel (`PAD_BLOCK`, in L1), its rows as wide as a whole number of vectors and, for a stride s, stored phase by
phase (`x'[i, w % s, w // s]`) so every window tap reads a contiguous vector; the window's sums (`ACC_BLOCK`) are
as wide, and only the real columns are stored (`OUT_BLOCK`). `schedules/plane_window.py` schedules them. Pools
take `pool_rows.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, te, tirx
from tvm.target import Target

from .cpu import cpu_model
from .relax_rewrite import batched_nchw, call_rewrites, depthwise_conv, int_lists, window_out_size

PAD_BLOCK, ACC_BLOCK, OUT_BLOCK = "plane_window_pad", "plane_window_acc", "plane_window"

Tap = Callable[[tirx.Var, tirx.Var, tirx.Var, tirx.Var, tirx.Var, tirx.Var], tirx.Expr]


def vector_width(columns: int, lanes: int) -> int:
    """Lanes of the vectors a row of `columns` outputs is computed in: the narrowest power of two up to `lanes` that
    needs no more vectors than `lanes` do (a 7-wide row in one 8-lane vector on AVX-512, not a 16-lane one)."""
    vectors = -(-columns // lanes)
    width = lanes
    while width > 1 and -(-columns // (width // 2)) == vectors:
        width //= 2
    return width


def _plane(x: te.Tensor, kernel: tuple[int, int], strides: list[int], padding: list[int], dilation: list[int],
           lanes: int) -> tuple[Tap, int, int, int]:
    """(the window's tap `(b, c, i, j, ry, rx) -> x'[..]` of the zero-padded, phase-split plane; out rows; out
    columns; columns rounded up to whole vectors)."""
    c, h, width = (int(d) for d in x.shape[1:])
    (kh, kw), (sh, sw), (dh, dw), (top, left, bottom, right) = kernel, strides, dilation, padding
    oh, ow = window_out_size(h, top, bottom, kh, sh, dh), window_out_size(width, left, right, kw, sw, dw)
    owv = -(-ow // vector_width(ow, lanes)) * vector_width(ow, lanes)
    rows, phase_width = (oh - 1) * sh + dh * (kh - 1) + 1, owv + dw * (kw - 1) // sw

    def padded(b: tirx.Var, ch: tirx.Var, i: tirx.Var, phase: tirx.Var, q: tirx.Var) -> tirx.Expr:
        row, col = i - top, q * sw + phase - left
        return tirx.if_then_else(tirx.all(row >= 0, row < h, col >= 0, col < width), x[b, ch, row, col],
                                 tirx.const(0, x.dtype))

    xp = te.compute((x.shape[0], c, rows, sw, phase_width), padded, name=PAD_BLOCK)
    return (lambda b, ch, i, j, ry, rx: xp[b, ch, i * sh + ry * dh, rx * dw % sw, j + rx * dw // sw]), oh, ow, owv


def plane_depthwise(x: te.Tensor, w: te.Tensor, strides: list[int], padding: list[int], dilation: list[int],
                    lanes: int) -> te.Tensor:
    """`y[n, c, i, j] = sum(x[n, c, i * sh + ry * dh - top, j * sw + rx * dw - left] * w[c, 0, ry, rx])`, zero
    outside the map."""
    kh, kw = (int(d) for d in w.shape[2:])
    tap, oh, ow, owv = _plane(x, (kh, kw), strides, padding, dilation, lanes)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    acc = te.compute((*x.shape[:2], oh, owv), lambda b, ch, i, j: te.sum(
        tap(b, ch, i, j, ry, rx) * w[ch, 0, ry, rx], axis=[ry, rx]), name=ACC_BLOCK)
    return te.compute((*x.shape[:2], oh, ow), lambda b, ch, i, j: acc[b, ch, i, j], name=OUT_BLOCK)


def is_plane_depthwise(call: relax.Call) -> bool:
    """Whether `call` is a depthwise conv (`relax_rewrite.depthwise_conv`) of a non-empty map."""
    return depthwise_conv(call) and batched_nchw(call) is not None


def plane_windows(target: Target) -> tvm.transform.Pass:
    """The module pass computing every NCHW depthwise conv left (after `block_conv_regions`) plane by plane."""
    lanes = cpu_model(target).lanes()

    def rewrite(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        if not is_plane_depthwise(call):
            return None
        ints = int_lists(call.attrs.strides, call.attrs.padding, call.attrs.dilation)
        return builder.call_te(plane_depthwise, call.args[0], call.args[1], *ints, lanes,
                               primfunc_name_hint="depthwise_plane")

    return call_rewrites("KilnPlaneWindows", rewrite)
