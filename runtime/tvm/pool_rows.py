"""NCHW max and average pools as one scheduled kernel that reduces each window down its columns, then along rows.

The plane kernel these pools ran as (`plane_window.py`, still the depthwise convs') copied each channel's padded plane
phase by phase for a stride, a scalar loop (TVM's vectorizer keeps no select whose condition differs by lane): a
3x3/2 max pool of 256x56² took 171 us against onnxruntime's 97. Here an (image, channel) task computes a block of
output rows in two passes through a row buffer on the stack (half the L1 data cache at most):

- down the columns: each output row's window maximum (or sum) over its `kh` input rows, in vectors of whole input
  rows (a row outside the map is a `fill` vector, selected by a condition the whole vector shares), stored at the
  row's padded column offset; the buffer's padding columns hold `fill`, written once per task;
- along the row: each output vector combines `kw` taps of the buffer. At a stride s > 1 a tap's lanes lie s apart,
  read as one load of s contiguous vectors and a shuffle of every s-th lane (vpermt2ps on AVX-512); taps in the
  same s-aligned window share the load. The buffer is wide enough for the last such load.

No lane is guarded: a row of columns no vector divides ends with a vector overlapping the one before it (the same
values computed and stored twice), and a block of output rows past the map's last is moved back the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.target import Target

from .cpu import cpu_model
from .relax_rewrite import batched_nchw, call_rewrites, int_lists, window_out_size
from .row_vectors import at, row_vector, splat

_POOLS = {tvm.ir.Op.get(f"relax.nn.{kind}_pool2d"): kind for kind in ("max", "avg")}
KERNEL_NAME = "pool_rows"


def pool_rows_kernel(kind: str, channels: int, height: int, width: int, kernel: list[int], strides: list[int],
                     padding: list[int], dilation: list[int], count_include_pad: bool, lanes: int,
                     buffer_bytes: int) -> tirx.PrimFunc:
    """The scheduled kernel of `relax.nn.{kind}_pool2d` (no `ceil_mode`) over float32 [N, channels, height, width]
    (N symbolic): the maximum over the map's elements of each window, or their sum over the window's size
    (`count_include_pad`) or over its elements inside the map. Its row buffer takes at most `buffer_bytes`."""
    (kh, kw), (sh, sw), (dh, dw), (top, left, bottom, right) = kernel, strides, dilation, padding
    oh, ow = window_out_size(height, top, bottom, kh, sh, dh), window_out_size(width, left, right, kw, sw, dw)
    vin, vout = row_vector(width, lanes), row_vector(ow, lanes)
    # a buffer row: the padded input columns, and room for the widest load of the last output vector's last tap
    span = -(-max((ow - vout) * sw + (kw - 1) * dw + vout * sw, left + width) // lanes) * lanes
    block = max(1, min(oh, buffer_bytes // (4 * span)))
    fill = tirx.min_value("float32") if kind == "max" else tirx.const(0, "float32")
    combine: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr] = (
        tirx.max if kind == "max" else lambda a, b: a + b)

    def inside(row: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.all(row >= 0, row < height)

    def column(x: tirx.Buffer, image: tirx.PrimExpr, channel: tirx.PrimExpr, i: tirx.PrimExpr,
               c0: tirx.PrimExpr) -> tirx.PrimExpr:
        """The window's `vin` columns from `c0` down the input rows of output row `i`."""
        rows = [i * sh + ry * dh - top for ry in range(kh)]
        return functools.reduce(combine, [tirx.Select(
            inside(row), x[image, channel, tirx.max(tirx.min(row, height - 1), 0), at(c0, vin)],
            splat(fill, vin)) for row in rows])

    def tap(buffer: tirx.Buffer, start: tirx.PrimExpr, offset: int) -> tirx.PrimExpr:
        """`vout` lanes `sw` apart from `start + offset` in the row buffer."""
        if sw == 1 or vout == 1:
            return buffer[at(start + offset, vout)]
        wide = buffer[tirx.Ramp(start + offset // sw * sw, 1, vout * sw)]
        return tirx.Shuffle([wide], [tirx.const(t * sw + offset % sw, "int32") for t in range(vout)])

    def scale(i: tirx.PrimExpr, j0: tirx.PrimExpr) -> tirx.PrimExpr:
        """1 / the elements averaged per output of the vector at `j0` in row `i`."""
        if count_include_pad:
            return splat(tirx.const(1 / (kh * kw), "float32"), vout)
        rows = functools.reduce(lambda a, b: a + b, [tirx.Select(inside(i * sh + ry * dh - top), 1, 0)
                                                     for ry in range(kh)])
        columns = at(j0, vout) * sw - left
        one, zero = splat(1, vout, "int32"), splat(0, vout, "int32")
        across = functools.reduce(lambda a, b: a + b, [tirx.Select(
            tirx.all(columns + rx * dw >= 0, columns + rx * dw < width), one, zero) for rx in range(kw)])
        return splat(tirx.const(1, "float32"), vout) / tirx.Cast(
            "float32" if vout == 1 else f"float32x{vout}", across * splat(rows, vout))

    def row(buffer: tirx.Buffer, r: tirx.PrimExpr, i: tirx.PrimExpr, j0: tirx.PrimExpr) -> tirx.PrimExpr:
        """Output row `i`'s vector at `j0` from buffer row `r`."""
        value = functools.reduce(combine, [tap(buffer, r * span + j0 * sw, rx * dw) for rx in range(kw)])
        return value if kind == "max" else value * scale(i, j0)

    @T.prim_func(private=True, check_well_formed=False)
    def pool(x_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        x = T.match_buffer(x_handle, (n, channels, height, width), "float32")
        out = T.match_buffer(out_handle, (n, channels, oh, ow), "float32")
        with T.sblock("root"):  # TVM's reshape detection (RewriteDataflowReshape) reads a kernel's root block
            for task in T.parallel(n * channels):
                buffer = T.decl_buffer((block * span,), "float32", scope="local")
                image = T.bind(task // channels)
                channel = T.bind(task % channels)
                for q in range(block * span // lanes):
                    buffer[T.ramp(q * lanes, 1, lanes)] = T.broadcast(fill, lanes)
                for b in range(-(-oh // block)):
                    i0 = T.bind(T.min(b * block, oh - block))
                    for r in range(block):
                        for v in T.unroll(-(-width // vin)):
                            c0 = T.bind(T.min(v * vin, width - vin))
                            buffer[at(r * span + left + c0, vin)] = column(x, image, channel, i0 + r, c0)
                    for r in range(block):
                        for v in T.unroll(-(-ow // vout)):
                            j0 = T.bind(T.min(v * vout, ow - vout))
                            out[image, channel, i0 + r, at(j0, vout)] = row(buffer, r, i0 + r, j0)

    return pool


def is_row_pool(call: relax.Call) -> bool:
    """Whether `call` is a float32 NCHW max or average pool without `ceil_mode`, static but for the batch and not
    empty. Disjoint windows too: TVM's kernel, vectorized across outputs, took twice as long for a 2x2/2 pool."""
    if call.op not in _POOLS or batched_nchw(call) is None:
        return False
    return not call.attrs.ceil_mode and call.attrs.layout == call.attrs.out_layout == "NCHW"


def row_pools(target: Target) -> tvm.transform.Pass:
    """The module pass computing every NCHW pool `is_row_pool` takes with `pool_rows_kernel`, its row buffer half the
    target's L1 data cache."""
    model = cpu_model(target)

    def rewrite(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        if not is_row_pool(call):
            return None
        a = call.attrs
        _, channels, height, width = batched_nchw(call)
        kind = _POOLS[call.op]
        kernel = pool_rows_kernel(kind, channels, height, width, *int_lists(a.pool_size, a.strides, a.padding,
                                                                              a.dilation),
                                  bool(a.count_include_pad), model.lanes(), model.caches.l1d // 2)
        return relax.call_tir(builder.add_func(kernel, f"{kind}_{KERNEL_NAME}"), [call.args[0]], call.ty)

    return call_rewrites("KilnRowPools", rewrite)
