"""bf16 convolutions on `vdpbf16ps` (AVX512-BF16) inside blocked regions (`conv_regions.py`): f32 sums of bf16
products, the input and output maps in the region's NCHW16c layout.

The input is cast and zero-padded (channels to whole blocks of 16, the map by the conv's padding) into
[N, C/16, Hp, Wp, 8] uint32, each word a pair of one block's channels c and c + 8, so the cast reads two contiguous
runs of eight f32 lanes and needs no shuffle; the weight is packed once, at build time, into
[O/16, C/16, KH, KW, 8, 16] pairs of the same channels, so one 512-bit load is a step's 16 output channels. The
kernel is `dot_bf16.dot_kernel`'s register tile with the conv's window in its addresses: `rows` consecutive output
pixels (along the flattened map, so a 7x7 map fills its tiles like a 49-row matrix) by `width` vectors of output
channels, summed over every input block, window row and column and pair. Each parallel task is one panel of
output channels over an even chunk of the map's row tiles, chunks outermost, so a thread's consecutive tasks read
the same input from L2; the last tile of the map moves back to end at its last pixel and stores some pixels twice.

A conv over too few input channels to fill a block (an RGB stem) pairs its window's columns instead: its input is
cast into row pairs (`row_pairs_input`: [N, C, Hp, Wp, 1] uint32, word j of a row holding columns j and j + 1)
and its weight into [O/16, C, KH, ceil(KW/2), 1, 16] pairs of columns (2m, 2m + 1), zero past KW; the same kernel,
each channel a block of one word, then reads word (x * stride + 2m) for pair m: a window of ceil(KW/2) columns at
dilation 2. ResNet's 7x7 stem over 3 channels is 84 `vdpbf16ps` per output vector where f32 takes 147 FMAs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
from tvm import relax, te, tirx
from tvm.script import tirx as T
from tvm.target import Target

from .bf16_layout import N_TILE, bf16_bits, even_chunks, task_place
from .conv_epilogue import HALF, PAIRS_IR, PLAIN, ConvEpilogue, unpairs
from .cpu import CPUModel, cpu_model
from .dot_bf16 import DOT_IR, dot_pairs, dot_tile, has_dot
from .row_vectors import zero_sums

CONV_KERNEL_NAME = "bf16_dot_conv"
CONV_PARAMS = "kiln.bf16_conv"  # a plain kernel's attribute: `conv_kernel`'s geometry, to rebuild it with an epilogue
DEPTHWISE_KERNEL_NAME = "bf16_depthwise"
DEPTHWISE_PARAMS = "kiln.bf16_depthwise"  # the same for `depthwise_kernel`
INPUT_PARAMS = "kiln.bf16_conv_input"  # a `bf16_input` kernel's attribute: its channels and padding
SKIP_PARAMS = "kiln.bf16_skip"  # a `bf16_skip` kernel's attribute, so `conv_fold.py` reads its pairs in a conv's store
PADDED_CHANNELS_LIMIT = 1.5  # more padded input channels than this per real one (3 -> 16) and f32 is faster
ROW_PAIR_MIN_PRODUCTS = 1024  # fewer products per output pixel and a conv over column pairs is slower than f32


def bf16_convs(target: Target | None) -> bool:
    """Whether a bf16 build for `target` computes its dense convs with this kernel (a CPU with 512-bit
    `vdpbf16ps`, AMX ones included); its other convs then stay f32, faster than bf16 widened to f32 FMAs."""
    return target is not None and target.kind.name == "llvm" and has_dot(cpu_model(target))


def takes_conv(in_channels: int, groups: int) -> bool:
    """Whether the bf16 kernel computes a conv over channel pairs: a dense one (groups 1) whose input channels fill
    their blocks well enough that bf16's doubled rate beats the zero channels it multiplies (an RGB input's 3 do
    not)."""
    padded = -(-in_channels // N_TILE) * N_TILE
    return groups == 1 and padded <= PADDED_CHANNELS_LIMIT * in_channels


def takes_row_pairs(weight_shape: Sequence[int], groups: int, dilation_w: int) -> bool:
    """Whether the bf16 kernel computes a dense conv `takes_conv` refuses over pairs of adjacent window columns
    instead: its columns must be adjacent (no dilation) and, paired, waste no more than channel blocks may (7 as 4
    pairs, 3 as 2; a 1x1 window's one column would be half zeros), and each output pixel must have at least
    `ROW_PAIR_MIN_PRODUCTS` products to pay for the cast of its input into pairs. On Zen 4 (batch 1, kernels
    alone) the bf16 conv and its cast took 0.62-0.79x the f32 conv's time at 1728-4800 products a pixel (3 -> 64
    channels at 3x3, 5x5 and 7x7; 8 -> 32 and 64 at 3x3) and 1.08-1.60x at 432 and 864 (3 -> 16 and 32 at 3x3)."""
    out_channels, in_channels, kh, kw = weight_shape
    return (groups == 1 and not takes_conv(in_channels, groups) and dilation_w == 1
            and -(-kw // 2) * 2 <= PADDED_CHANNELS_LIMIT * kw
            and out_channels * in_channels * kh * kw >= ROW_PAIR_MIN_PRODUCTS)


def pack_row_pair_weight(w: np.ndarray) -> np.ndarray:
    """An f32 `[O, C, KH, KW]` weight rounded to nearest-even bf16 and packed for a `row_pairs_input` map: uint32
    `[O/16, C, KH, ceil(KW/2), 1, 16]` (zero past O and KW), word (ob, c, y, m, 0, o) holding columns 2m (low half)
    and 2m + 1 (high half) of output channel 16 ob + o's channel c."""
    o, c, kh, kw = w.shape
    blocks_out, pairs = -(-o // N_TILE), -(-kw // 2)
    bits = np.zeros((blocks_out * N_TILE, c, kh, pairs * 2), np.uint32)
    bits[:o, ..., :kw] = w.astype(ml_dtypes.bfloat16).view(np.uint16)
    # [ob, o, c, y, m, half] -> [ob, c, y, m, o, half]
    split = bits.reshape(blocks_out, N_TILE, c, kh, pairs, 2).transpose(0, 2, 3, 4, 1, 5)
    return np.ascontiguousarray(split[..., 0] | (split[..., 1] << 16))[:, :, :, :, None]


def pack_conv_weight(w: np.ndarray) -> np.ndarray:
    """An f32 `[O, I, KH, KW]` weight rounded to nearest-even bf16 and packed as the kernel reads it: uint32
    `[O/16, I/16, KH, KW, 8, 16]` (zero past O and I), word (ob, cb, y, x, q, o) holding input channels
    16 cb + q (low half) and 16 cb + q + 8 (high half) of output channel 16 ob + o."""
    o, i, kh, kw = w.shape
    blocks_out, blocks_in = -(-o // N_TILE), -(-i // N_TILE)
    bits = np.zeros((blocks_out * N_TILE, blocks_in * N_TILE, kh, kw), np.uint32)
    bits[:o, :i] = w.astype(ml_dtypes.bfloat16).view(np.uint16)
    # [ob, o, cb, half, q, y, x] -> [ob, cb, y, x, q, o, half]
    split = bits.reshape(blocks_out, N_TILE, blocks_in, 2, HALF, kh, kw).transpose(0, 2, 5, 6, 4, 1, 3)
    return np.ascontiguousarray(split[..., 0] | (split[..., 1] << 16))


def _padded_bits(x: te.Tensor, channels: int, padding: list[int]
                 ) -> Callable[[tirx.Var, tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr]:
    """The bf16 bits (uint32) of `x` (NCHW f32, or NCHW16c) at (image, channel, row, column) of its map padded by
    `padding` (top, left, bottom, right): zero in the padding and past `channels` or the padded width."""
    h, w = (int(d) for d in x.shape[2:4])
    top, left, _, _ = padding

    def value(b: tirx.Var, c: tirx.PrimExpr, i: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        inside = tirx.all(c < channels, i >= top, i < top + h, j >= left, j < left + w)
        y, v, cc = tirx.min(tirx.max(i - top, 0), h - 1), tirx.min(tirx.max(j - left, 0), w - 1), \
            tirx.min(c, channels - 1)
        read = x[b, cc, y, v] if len(x.shape) == 4 else x[b, cc // N_TILE, y, v, cc % N_TILE]
        return bf16_bits(tirx.if_then_else(inside, read, tirx.const(0, x.dtype)))

    return value


def _padded_map(x: te.Tensor, padding: list[int]) -> tuple[int, int]:
    """(height, width) of `x`'s map padded by `padding` (top, left, bottom, right)."""
    top, left, bottom, right = padding
    return int(x.shape[2]) + top + bottom, int(x.shape[3]) + left + right


def bf16_input(x: te.Tensor, channels: int, padding: list[int]) -> te.Tensor:
    """The conv's input (NCHW f32 at a region's start, else NCHW16c) as the kernel reads it: bf16 pairs
    `[N, C/16, H + top + bottom, W + left + right, 8]`, zero in the padding and past `channels`. Elementwise, so
    FuseOps joins it to the ops that produce x (a bias, an activation)."""
    value, blocks = _padded_bits(x, channels, padding), -(-channels // N_TILE)
    return te.compute((x.shape[0], blocks, *_padded_map(x, padding), HALF), lambda b, cb, i, j, q: value(
        b, cb * N_TILE + q, i, j) | (value(b, cb * N_TILE + q + HALF, i, j) << tirx.const(16, "uint32")),
        name="bf16_conv_input")


def row_pairs_input(x: te.Tensor, channels: int, padding: list[int]) -> te.Tensor:
    """The input of a conv over column pairs (`takes_row_pairs`) as the kernel reads it: `[N, C, H + top + bottom,
    Wr, 1]` uint32, word (b, c, i, j, 0) holding columns j (low half) and j + 1 (high half) of channel c of the
    padded map, zero outside the map; each channel's plane apart, so the cast reads and writes contiguous rows, of
    `Wr` words: W + left + right rounded up to whole vectors (a row of 230 was cast 10 words at a time, at half
    the speed)."""
    value = _padded_bits(x, channels, padding)
    height, width = _padded_map(x, padding)
    return te.compute((x.shape[0], channels, height, -(-width // N_TILE) * N_TILE, 1), lambda b, c, i, j, _: value(
        b, c, i, j) | (value(b, c, i, j + 1) << tirx.const(16, "uint32")), name="bf16_row_pairs")


def marked_cast(builder: relax.BlockBuilder, x: relax.Expr, channels: int, padding: list[int]) -> relax.Call:
    """A call of `bf16_input` on `x` (its kernel added to `builder`'s module), marked with `INPUT_PARAMS` so
    `conv_fold.py` can compute it in the store of the conv producing x."""
    cast = builder.call_te(bf16_input, x, channels, padding, primfunc_name_hint="bf16_conv_input")
    builder.update_func(cast.args[0], builder.get()[cast.args[0]].with_attr(INPUT_PARAMS, [channels, *padding]))
    return cast


def pairs_max_pool(pairs: te.Tensor, pool_size: list[int], strides: list[int], padding: list[int],
                   out_shape: list[int]) -> te.Tensor:
    """A max pool of an unpadded `bf16_input` map, computed on its pairs and stored as pairs: rounding to bf16 is
    monotonic, so this is the bf16 rounding of the f32 pool, and the conv before the pool stores half the bytes
    (ResNet's stem: a 26 MB f32 map at batch 8) with no cast after the pool. A window's rows and columns past the
    map read its nearest edge, which lies in the same window (undilated, no ceil mode), so they change no max."""
    h, w = (int(d) for d in pairs.shape[2:4])
    (kh, kw), (sh, sw), (top, left) = pool_size, strides, padding[:2]
    high = tirx.const(0xFFFF0000, "uint32")

    def word(b: tirx.Var, cb: tirx.Var, i: tirx.Var, j: tirx.Var, q: tirx.Var) -> tirx.PrimExpr:
        lo = hi = None
        for ky in range(kh):
            for kx in range(kw):
                y = tirx.min(tirx.max(i * sh + ky - top, 0), h - 1)
                x = tirx.min(tirx.max(j * sw + kx - left, 0), w - 1)
                pair = pairs[b, cb, y, x, q]
                low = tirx.reinterpret("float32", pair << tirx.const(16, "uint32"))
                upper = tirx.reinterpret("float32", pair & high)
                lo = low if lo is None else tirx.max(lo, low)
                hi = upper if hi is None else tirx.max(hi, upper)
        return (tirx.reinterpret("uint32", lo) >> tirx.const(16, "uint32")) | (tirx.reinterpret("uint32", hi) & high)

    return te.compute((pairs.shape[0], pairs.shape[1], *out_shape, HALF), word, name="bf16_max_pool")


def marked_skip(builder: relax.BlockBuilder, pairs: relax.Expr) -> relax.Call:
    """A call of `bf16_skip` on `pairs`, marked with `SKIP_PARAMS` so `conv_fold.py` reads the pairs in the store
    of a conv that adds them."""
    call = builder.call_te(bf16_skip, pairs, primfunc_name_hint="bf16_skip")
    builder.update_func(call.args[0], builder.get()[call.args[0]].with_attr(SKIP_PARAMS, []))
    return call


def bf16_skip(pairs: te.Tensor) -> te.Tensor:
    """An unpadded `bf16_input` map back as NCHW16c f32: a residual's skip read as the bf16 values the next conv
    reads, so the conv producing it stores only its pairs (`conv_fold.py`)."""
    def value(b: tirx.Var, cb: tirx.Var, i: tirx.Var, j: tirx.Var, c: tirx.Var) -> tirx.PrimExpr:
        word = pairs[b, cb, i, j, c % HALF]
        half = tirx.Select(c < HALF, word & tirx.const(0xFFFF, "uint32"), word >> tirx.const(16, "uint32"))
        return tirx.reinterpret("float32", half << tirx.const(16, "uint32"))

    return te.compute((*pairs.shape[:4], N_TILE), value, name="bf16_skip")


def _attrs(kind: str, geometry: list[int], epilogue: ConvEpilogue) -> dict:
    """A kernel's function attributes: scheduled, unaliased, and, storing plain sums, its geometry under `kind` (so
    `conv_fold.py` can rebuild it with an epilogue)."""
    return {"tirx.noalias": True, "tirx.is_scheduled": True, **({kind: geometry} if epilogue == PLAIN else {})}


def _chunk(model: CPUModel, rows: int, words: int, kh: int) -> int:
    """Row tiles of `rows` output pixels per chunk: the input rows a chunk reads (`kh` of them per output row,
    `words` pairs per pixel) in half of L2."""
    return max(1, model.caches.l2 // 2 // (rows * words * 4 * kh))


def conv_kernel(in_blocks: int, in_shape: tuple[int, int], window: tuple[int, int], strides: list[int],
                dilation: list[int], out_shape: tuple[int, int], out_blocks: int, model: CPUModel,
                epilogue: ConvEpilogue = PLAIN, depth: int = HALF) -> tirx.PrimFunc:
    """The `vdpbf16ps` conv over a `bf16_input` map A [batch, in_blocks, *in_shape (padded), 8] and a packed weight
    B [out_blocks, in_blocks, *window, 8, 16], storing C [batch, out_blocks, *out_shape, 16] f32 or what an
    `epilogue` computes from it, for `model`'s cores, L2 and registers; a `row_pairs_input` map's blocks are its
    channels, of `depth` 1 (the window's pairs of columns at dilation 2). A plain kernel records its geometry
    (`CONV_PARAMS`), so a pass can rebuild it with an epilogue."""
    hp, wp = in_shape
    kh, kw = window
    oh, ow = out_shape
    attrs = _attrs(CONV_PARAMS, [in_blocks, hp, wp, kh, kw, *strides, *dilation, oh, ow, out_blocks, depth], epilogue)
    pixels, lanes = oh * ow, N_TILE
    tall, width = dot_tile(pixels if pixels < 16 else None, out_blocks, model.vector_registers)
    panels, mblocks = out_blocks // width, -(-pixels // tall)
    chunk, cores = _chunk(model, tall, in_blocks * depth, kh), model.cores

    @T.prim_func(private=True)
    def kernel(a_data: T.handle, w_data: T.handle):
        T.func_attr(attrs)
        batch = T.int64()
        a = T.match_buffer(a_data, (batch, in_blocks, hp, wp, depth), "uint32")
        w = T.match_buffer(w_data, (out_blocks, in_blocks, kh, kw, depth, lanes), "uint32")
        operands, outputs = epilogue.params(batch, out_blocks, out_shape)
        with T.attr(0, "pragma_import_llvm", DOT_IR + PAIRS_IR):
            chunks = T.bind(even_chunks(mblocks, chunk, cores, batch * panels))
            for task in T.parallel(chunks * batch * panels):
                nb, bb, first, last = task_place(task, panels, batch, mblocks, chunks)
                sums = T.decl_buffer((tall * width * lanes,), "float32", scope="local")
                for tile in range(first, last):
                    p0 = T.bind(T.min(tile * tall, pixels - tall))
                    zero_sums(sums, tall * width, N_TILE)
                    for cb, ky, kx, q in T.grid(in_blocks, kh, kw, depth):
                        for r in T.unroll(tall):
                            pair = T.bind(T.reinterpret(T.broadcast(a[
                                bb, cb, (p0 + r) // ow * strides[0] + ky * dilation[0],
                                (p0 + r) % ow * strides[1] + kx * dilation[1], q], lanes), dtype="int32x16"))
                            for g in T.unroll(width):
                                at = T.bind((r * width + g) * lanes)
                                sums[T.ramp(at, 1, lanes)] = dot_pairs(
                                    sums[T.ramp(at, 1, lanes)], pair,
                                    w.vload([nb * width + g, cb, ky, kx, q, 0], "uint32x16"))
                    for r in T.unroll(tall):
                        for g in T.unroll(width):
                            epilogue.store(operands, outputs, sums, (r * width + g) * lanes, bb, nb * width + g,
                                           (p0 + r) // ow, (p0 + r) % ow)
            epilogue.zero_borders(outputs, batch, out_blocks, out_shape)
    return kernel


def depthwise_kernel(blocks: int, in_shape: tuple[int, int], window: tuple[int, int], strides: list[int],
                     dilation: list[int], out_shape: tuple[int, int], model: CPUModel,
                     epilogue: ConvEpilogue = PLAIN) -> tirx.PrimFunc:
    """A depthwise conv over a `bf16_input` map A [batch, blocks, *in_shape (padded), 8] and an f32 weight packed
    [blocks, 1, KH, KW, 16] (`conv_layout.pack_weight`), storing C [batch, blocks, *out_shape, 16] f32 or what an
    `epilogue` computes from it. Each window position is one f32 FMA per pixel of a tile of `rows` consecutive
    output pixels, on the input's 8 words unpacked (`unpairs`): the map is read in half the bytes of f32 (a
    depthwise conv does 9 or 25 FMAs per input vector, so its time is its maps'), and the conv before it stores
    only those pairs. A plain kernel records its geometry (`DEPTHWISE_PARAMS`) so `conv_fold.py` can rebuild it
    with an epilogue."""
    hp, wp = in_shape
    kh, kw = window
    oh, ow = out_shape
    attrs = _attrs(DEPTHWISE_PARAMS, [blocks, hp, wp, kh, kw, *strides, *dilation, oh, ow], epilogue)
    pixels = oh * ow
    rows = min(pixels, model.vector_registers // 4)  # sums; the rest hold the weight and the unpacked inputs
    mblocks = -(-pixels // rows)
    chunk, cores = _chunk(model, rows, HALF, kh), model.cores

    @T.prim_func(private=True)
    def kernel(a_data: T.handle, w_data: T.handle):
        T.func_attr(attrs)
        batch = T.int64()
        a = T.match_buffer(a_data, (batch, blocks, hp, wp, HALF), "uint32")
        w = T.match_buffer(w_data, (blocks, 1, kh, kw, N_TILE), "float32")
        operands, outputs = epilogue.params(batch, blocks, out_shape)
        with T.attr(0, "pragma_import_llvm", PAIRS_IR):
            chunks = T.bind(even_chunks(mblocks, chunk, cores, batch * blocks))
            for task in T.parallel(chunks * batch * blocks):
                cb, bb, first, last = task_place(task, blocks, batch, mblocks, chunks)
                sums = T.decl_buffer((rows * N_TILE,), "float32", scope="local")
                for tile in range(first, last):
                    p0 = T.bind(T.min(tile * rows, pixels - rows))
                    zero_sums(sums, rows, N_TILE)
                    for ky, kx in T.grid(kh, kw):
                        weight = T.bind(w.vload([cb, 0, ky, kx, 0], "float32x16"))
                        for r in T.unroll(rows):
                            at = T.bind(r * N_TILE)
                            sums[T.ramp(at, 1, N_TILE)] = sums[T.ramp(at, 1, N_TILE)] + unpairs(a.vload([
                                bb, cb, (p0 + r) // ow * strides[0] + ky * dilation[0],
                                (p0 + r) % ow * strides[1] + kx * dilation[1], 0], "uint32x8")) * weight
                    for r in T.unroll(rows):
                        epilogue.store(operands, outputs, sums, r * N_TILE, bb, cb, (p0 + r) // ow, (p0 + r) % ow)
            epilogue.zero_borders(outputs, batch, blocks, out_shape)
    return kernel


def rebuilt_kernel(kind: str, geometry: list[int], model: CPUModel, epilogue: ConvEpilogue) -> tirx.PrimFunc:
    """The kernel a plain one's geometry attribute `kind` (`CONV_PARAMS`, `DEPTHWISE_PARAMS`) describes, storing
    `epilogue`."""
    if kind == DEPTHWISE_PARAMS:
        blocks, hp, wp, kh, kw, sh, sw, dh, dw, oh, ow = geometry
        return depthwise_kernel(blocks, (hp, wp), (kh, kw), [sh, sw], [dh, dw], (oh, ow), model, epilogue)
    in_blocks, hp, wp, kh, kw, sh, sw, dh, dw, oh, ow, out_blocks, depth = geometry
    return conv_kernel(in_blocks, (hp, wp), (kh, kw), [sh, sw], [dh, dw], (oh, ow), out_blocks, model, epilogue,
                       depth)
