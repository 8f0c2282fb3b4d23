"""A blocked map back to NCHW (`conv_layout.from_blocked`) as one hand-written kernel: each tile of `lanes` pixels
x `lanes` channels is read as `lanes` whole vectors (one pixel's channels each), transposed in registers by
log2(lanes) stages of two-vector shuffles, and stored as `lanes` vectors of pixels, one a channel.

Scheduled as a transpose (`schedules/injective.schedule_transpose`), every output vector gathered its pixels one
float a cache line, as scalar inserts: the exit of a 1x1 conv 64 -> 256 over 56² took 0.256 ms against the conv's
0.453, here 0.043 (Zen 4). Both maps are read through views with their pixels flat, so a 1x1 conv's map of one row
of pixels needs no reshape (a reshape is a call of the VM, about 3 us). A map narrower than one tile keeps the
transpose schedule; a ragged last tile overlaps the one before it, and the pixels it shares are stored twice with
the same values.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as ib

from .conv_layout import from_blocked
from .row_vectors import at

KERNEL_NAME = "from_blocked"


def transposed(rows: list[tirx.PrimExpr], lanes: int,
               bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = ib.bind) -> list[tirx.PrimExpr]:
    """The `lanes` vectors whose lane i of vector j is lane j of `rows[i]`, each stage's vectors passed through
    `bind` (by default bound in the kernel being parsed). Stage k swaps bit k of the vector index with bit k of the
    lane index: the new vector v takes lane p from the old vector whose bit k is p's, at the lane whose bit k is v's
    (one two-source shuffle each)."""
    vectors = list(rows)
    bit = 1
    while bit < lanes:
        stage = []
        for v in range(lanes):
            mask = [(lanes if p & bit else 0) + (p & ~bit | v & bit) for p in range(lanes)]
            pair = [vectors[v & ~bit], vectors[v | bit]]
            stage.append(bind(tirx.Shuffle(pair, [tirx.const(i, "int32") for i in mask])))
        vectors, bit = stage, bit * 2
    return vectors


def from_blocked_kernel(in_shape: tuple[int, int, int], out_shape: tuple[int, int, int], lanes: int
                        ) -> tirx.PrimFunc:
    """The kernel of a blocked map `[n, *in_shape, lanes]` (`[C / lanes, H, W]`, or `[C / lanes, 1, H * W]` as a
    1x1 conv computes it; n symbolic) to NCHW `[n, *out_shape]` (`[C, H, W]`), for maps of at least `lanes` pixels:
    a task per tile of `lanes` pixels of one channel block, both maps read through views with their pixels flat."""
    blocks, channels = in_shape[0], out_shape[0]
    pixels = in_shape[1] * in_shape[2]
    tiles = -(-pixels // lanes)

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(xb_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        xb_map = T.match_buffer(xb_handle, (n, *in_shape, lanes), "float32")
        out_map = T.match_buffer(out_handle, (n, *out_shape), "float32")
        with T.sblock("root"):
            xb = T.decl_buffer((n, blocks, pixels, lanes), "float32", data=xb_map.data)
            out = T.decl_buffer((n, channels, pixels), "float32", data=out_map.data)
            for task in T.parallel(n * (blocks * tiles)):
                image = T.bind(task // (blocks * tiles))
                block = T.bind(task // tiles % blocks)
                start = T.bind(T.min(task % tiles * lanes, pixels - lanes))
                _store_tile(xb, out, image, block, start, channels, lanes)

    return kernel


def _store_tile(xb: tirx.Buffer, out: tirx.Buffer, image: tirx.PrimExpr, block: tirx.PrimExpr,
                start: tirx.PrimExpr, channels: int, lanes: int) -> None:
    """Emit one tile's loads, transpose and stores; a channel past `channels` (the last block's padding) is not
    stored."""
    rows = [xb[image, block, start + i, at(0, lanes)] for i in range(lanes)]
    for k, vector in enumerate(transposed(rows, lanes)):
        channel = block * lanes + k
        if channels % lanes == 0:
            ib.buffer_store(out, vector, [image, channel, at(start, lanes)])
            continue
        with ib.If(channel < channels):
            with ib.Then():
                ib.buffer_store(out, vector, [image, channel, at(start, lanes)])


def blocked_exit(builder: relax.BlockBuilder, xb: relax.Expr, out: list) -> relax.Expr:
    """The NCHW map of shape `out` (`[n, C, H, W]`, n perhaps symbolic) of the blocked map `xb` (`[n, C / b, H, W,
    b]` or a 1x1 conv's `[n, C / b, 1, H * W, b]`): this module's float32 kernel, or `from_blocked`'s where the map
    is narrower than one tile or of another type."""
    _, blocks, height, width, lanes = (int(d) if isinstance(d, tirx.IntImm) else d for d in xb.ty.shape)
    if xb.ty.dtype != "float32" or out[2] * out[3] < lanes or lanes & (lanes - 1):
        if [height, width] != out[2:]:
            xb = builder.emit(relax.op.reshape(xb, [out[0], blocks, *out[2:], lanes]))
        return builder.call_te(from_blocked, xb, out[1], primfunc_name_hint=KERNEL_NAME)
    kernel = builder.add_func(from_blocked_kernel((blocks, height, width), tuple(out[1:]), lanes), KERNEL_NAME)
    return relax.call_tir(kernel, [xb], relax.TensorType(out, "float32"))
