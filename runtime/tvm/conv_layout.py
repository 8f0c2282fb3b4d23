"""The NCHW[x]c layout of blocked convs: which convs the CPU model blocks, the packed weight, the blocked conv kernel
and the conversions in and out of a blocked region (`conv_regions.py` is the Relax rewrite that places them).

A 3x3 conv whose output width fills its vector tiles badly (28 = 14 + 14 columns, 8 + 6 lanes each; 14) ran at a
third of onnxruntime's speed. Computed as `y[n, o // b, h, w, o % b]` with the weight stored
`[O / b, I, KH, KW, b]` (b = vector lanes, zero rows past O), `CPUMatmul` vectorizes over output channels and
tiles output columns as its rows, reading one contiguous weight vector per reduction step. Activations stay in
that layout between blocked convs and the elementwise ops between them; a weight that is a constant
(`params="bound"`) is packed in numpy at build time, any other weight (`params="inputs"`) by a kernel of the program.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx, topi

from .schedules.matmul import CPUMatmul

BLOCKED_NAME = "conv2d_nchw_blocked"  # the PrimFunc name hint of a blocked conv (its block is `conv_blocked`)
DEPTHWISE_NAME = "depthwise_blocked"  # that of a depthwise conv inside a blocked region


def lanes_filled(extent: int, tile: int, lanes: int) -> float:
    """The fraction of vector lanes doing work when `extent` elements go in tiles of `tile` (in whole vectors)."""
    return extent / (-(-extent // tile) * -(-tile // lanes) * lanes)


def blocks_output_channels(out_channels: int, out_width: int, rule: CPUMatmul) -> bool:
    """Whether vectors over output channels fill at least as many lanes as vectors along the output width, as `rule`
    (a `CPUMatmul` sized `for_cpu`) tiles it. On a tie blocked wins: its vector operand is the packed weight, read
    aligned and reused by every output pixel, where NCHW's is the input map at `ow + kw` (with activations blocked
    between convs nothing is converted; the 1x1 conv 64x56² -> 256 ran 1.8x faster blocked on AVX2). A map
    narrower than one vector blocks too: the rule keeps its columns in one row tile (ResNet's 7² convs ran
    1.6-2.7x faster blocked than NCHW on a Zen 3 core)."""
    lanes = rule.lanes or 1
    width = lanes_filled(out_width, rule.vector_tile(tirx.IntImm("int32", out_width)), lanes)
    return lanes_filled(out_channels, lanes, lanes) >= width


def pixel_rows(w_shape: list[int], strides: list[int], padding: list[int], dilation: list[int]) -> bool:
    """Whether a conv is a matmul over its pixels: 1x1, stride 1, no padding. Its map is then computed as one row
    of `H * W` pixels (a reshape of the NCHW or NCHW[x]c input and output, which costs no copy), so `CPUMatmul`'s
    register tile takes rows dividing `H * W` rather than the map's width (7 of a 7² map)."""
    return w_shape[2:] == [1, 1] and strides == [1, 1] and not any(padding)


def pack_weight(w: np.ndarray, block: int) -> np.ndarray:
    """`[O, I, KH, KW]` as `[ceil(O / block), I, KH, KW, block]`, zero past O."""
    o = w.shape[0]
    padded = np.zeros((-(-o // block) * block, *w.shape[1:]), w.dtype)
    padded[:o] = w
    return np.ascontiguousarray(padded.reshape(-1, block, *w.shape[1:]).transpose(0, 2, 3, 4, 1))


def pack_te(w: te.Tensor, block: int) -> te.Tensor:
    o, i, kh, kw = (int(d) for d in w.shape)
    return te.compute((-(-o // block), i, kh, kw, block), lambda ob, c, y, x, v: tirx.if_then_else(
        ob * block + v < o, w[tirx.min(ob * block + v, o - 1), c, y, x], tirx.const(0, w.dtype)), name="pack")


def blocked_conv(x: te.Tensor, wp: te.Tensor, in_channels: int, strides: list[int], padding: list[int],
                 dilation: list[int]) -> te.Tensor:
    """NCHW[b]c out (b = `wp.shape[-1]`), from an NCHW[b]c `x` inside a region or an NCHW one at its start (read in
    place: converting the input first cost a copy as slow as a strided conv). The sum over the `in_channels` real
    input channels walks them block by block, never reading padding channels; the map's zero padding is folded in."""
    n = x.shape[0]  # the batch, perhaps symbolic
    h, w = (int(d) for d in x.shape[2:4])
    _, _, kh, kw, block = (int(d) for d in wp.shape)
    top, left, bottom, right = padding
    pads = ([0, 0, top, left], [0, 0, bottom, right]) if len(x.shape) == 4 else \
        ([0, 0, top, left, 0], [0, 0, bottom, right, 0])
    xp = topi.nn.pad(x, *pads) if any(padding) else x

    def read(b: tirx.Var, c: tirx.Var, i: tirx.Expr, j: tirx.Expr) -> tirx.Expr:
        return xp[b, c, i, j] if len(x.shape) == 4 else xp[b, c // block, i, j, c % block]

    oh = (h + top + bottom - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (w + left + right - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    rc, ry, rx = te.reduce_axis((0, in_channels), "rc"), te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    return te.compute((n, wp.shape[0], oh, ow, block), lambda b, o, i, j, v: te.sum(
        read(b, rc, i * strides[0] + ry * dilation[0], j * strides[1] + rx * dilation[1]) * wp[o, rc, ry, rx, v],
        axis=[rc, ry, rx]), name="conv_blocked")


def blocked_depthwise(x: te.Tensor, wp: te.Tensor, strides: list[int], padding: list[int],
                      dilation: list[int]) -> te.Tensor:
    """A depthwise conv (one filter per channel, the weight packed as `[C / b, 1, KH, KW, b]`) of an NCHW[b]c `x`
    inside a region: channel lanes stay lanes, so every window position is one vector multiply-add (a window
    reduction: `CPUWindowReduction` schedules it)."""
    n = x.shape[0]
    h, w, block = (int(d) for d in x.shape[2:])
    _, _, kh, kw, _ = (int(d) for d in wp.shape)
    top, left, bottom, right = padding
    xp = topi.nn.pad(x, [0, 0, top, left, 0], [0, 0, bottom, right, 0]) if any(padding) else x
    oh = (h + top + bottom - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (w + left + right - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    return te.compute((n, wp.shape[0], oh, ow, block), lambda b, c, i, j, v: te.sum(
        xp[b, c, i * strides[0] + ry * dilation[0], j * strides[1] + rx * dilation[1], v] * wp[c, 0, ry, rx, v],
        axis=[ry, rx]), name="depthwise_blocked")


def to_blocked(x: te.Tensor, block: int) -> te.Tensor:
    """`[N, C, ...]` as `[N, ceil(C / block), ..., block]`, zero past C: an NCHW operand of a blocked elementwise op
    (a residual's skip branch, a per-channel vector)."""
    n = x.shape[0]
    c, *rest = (int(d) for d in x.shape[1:])
    return te.compute((n, -(-c // block), *rest, block), lambda b, cb, *ix: tirx.if_then_else(
        cb * block + ix[-1] < c, x[(b, tirx.min(cb * block + ix[-1], c - 1), *ix[:-1])], tirx.const(0, x.dtype)),
        name="to_blocked")


def from_blocked(xb: te.Tensor, channels: int) -> te.Tensor:
    """The inverse of `to_blocked`: the `channels` real channels back in NCHW order."""
    n = xb.shape[0]
    *rest, block = (int(d) for d in xb.shape[2:])
    return te.compute((n, channels, *rest), lambda b, c, *ix: xb[(b, c // block, *ix, c % block)], name="from_blocked")
