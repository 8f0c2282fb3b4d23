"""bf16 matmuls on AMX-BF16 tiles: C[M, N] f32 = A[M, K] bf16 x B[K, N] bf16, for a bound (constant) B or, batched,
for two activations (attention's q @ k^T and p @ v).

The geometry is AMX's palette 1, the same on every CPU that has it: 8 tile registers of 16 rows x 64 bytes, so a
bf16 A tile is 16 rows x 32 K values, a B tile 16 K pairs x 16 columns (each row 16 interleaved (k, k+1) pairs) and
an f32 C tile 16 x 16. The kernel keeps 2 x 2 C tiles (1 x 2 below 16 rows, with tiles configured to M rows)
resident while it walks K, loading 2 A and 2 B tiles per step, and stores them once; each parallel task is a
32-column panel whose thread configures its tiles once and walks the panel's M blocks, so the panel of B is read
from memory once per call (A, M x K, is what the caches hold). B is packed into [N/16, K/2, 16, 2] (each B tile
1 KiB contiguous; written as uint32 pairs, so a pack stores whole vectors), zero-padded to whole tiles: a bound
weight once, by constant folding at build time, an activation per call by an elementwise kernel FuseOps joins to
its producer; A's bf16 cast (and zero padding) is one elementwise kernel in front. A product's elementwise
consumer can run in the kernel's store instead of reading C back (`Epilogue`, found by `amx_epilogue.py`).

The operands in front of the kernel and the copy behind it serve `dot_bf16.py`'s `vdpbf16ps` kernel as well, on
CPUs with AVX512-BF16 but no tiles: `product_kernel` chooses between the two.
"""

from __future__ import annotations

from collections.abc import Mapping

import tvm
from tvm import relax, te, tirx
from tvm.relax import op as R
from tvm.script import tirx as T
from tvm.target import Target

from .bf16_layout import N_TILE, PAIR, TILE_PARAMS, Epilogue, bf16_bits, result_params, store_epilogue
from .cpu import cpu_model
from .dot_bf16 import DOT_KERNEL_NAME, dot_kernel, has_dot
from .relax_rewrite import element_count
from .rule import OpCall

AMX_BF16 = "amx-bf16"  # LLVM's feature name of AMX's bf16 tiles
KERNEL_NAME = "amx_bf16_matmul"  # the PrimFunc's name: an executable whose op map names it runs tile instructions
TILE_ROWS = 16  # rows of a tile register (palette 1)
TILE_BYTES = 64  # bytes of a tile row
K_STEP = TILE_BYTES // 2  # bf16 K values in an A tile row
TILE_CONFIG_BYTES = 64  # ldtilecfg's operand: palette, start row, 16 x u16 bytes per row, 16 x u8 rows
C_ROWS, C_COLS = 2, 2  # resident C tiles: 4 C + 2 A + 2 B = the 8 tile registers


def has_tiles(target: Target | None) -> bool:
    """Whether `target`'s CPU has AMX-BF16 tiles (a bf16 build for it multiplies bound weights on them)."""
    return target is not None and target.kind.name == "llvm" and AMX_BF16 in cpu_model(target).features


def runs_tiles(target: str, op_map: Mapping[str, Mapping[str, object]]) -> bool:
    """Whether an executable built for `target` with this op map (`op_map.build_map`) calls the AMX kernel: its
    CPU has tiles and a kernel name in the map starts with `KERNEL_NAME` (an input of that name on a CPU without
    tiles is no kernel)."""
    return has_tiles(Target(target)) and \
        any(name.startswith(KERNEL_NAME) for names in op_map.values() for name in names)


def bf16_products(target: Target | None) -> bool:
    """Whether a bf16 build for `target` computes its products with a bf16 kernel: AMX tiles (`tile_kernel`) or
    512-bit `vdpbf16ps` (`dot_bf16.dot_kernel`); elsewhere bf16 operands are widened to f32 FMAs."""
    return has_tiles(target) or target is not None and target.kind.name == "llvm" and has_dot(cpu_model(target))


def product_kernel(target: Target, rows: int, kp: int, np_: int, shared_b: bool, epilogue: Epilogue | None = None
                   ) -> tuple[tirx.PrimFunc, str]:
    """(kernel, name) of the bf16 product over the padded operands for `target`'s CPU (`bf16_products`): AMX tiles
    where it has them, else `vdpbf16ps` register tiles; an `epilogue` is computed in the kernel's store."""
    model = cpu_model(target)
    if has_tiles(target):
        return tile_kernel(rows, kp, np_, shared_b, model.cores, model.caches.l2, epilogue), KERNEL_NAME
    return dot_kernel(rows, kp, np_, shared_b, model.cores, model.caches.l2, model.vector_registers,
                      epilogue), DOT_KERNEL_NAME


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _intrin(name: str, *args: object) -> tirx.PrimExpr:
    return T.call_llvm_intrin("void", f"llvm.x86.{name}", *args)


def tile_kernel(rows: int, kp: int, np_: int, shared_b: bool, cores: int, l2_bytes: int,
                epilogue: Epilogue | None = None) -> tirx.PrimFunc:
    """The AMX kernel over padded operands A [batch, Mp, kp] bf16, packed B [batch (1 if `shared_b`), np_/16, kp/2,
    16] bf16 pairs (uint32, `_packed_pairs`) and C [batch, Mp, np_] f32 (kp, np_ whole tiles; Mp any multiple of
    32, or `rows` < 16 itself: then each tile is configured to `rows`). A shared B (a bound weight) is one matrix
    every batch multiplies by.

    Each parallel task is one 32-column panel of one batch over a chunk of M: the rows of A that fill half of
    `l2_bytes` (fewer where there are fewer panels than `cores`, so every core gets work). Its thread configures
    its tiles once (ldtilecfg and tilerelease cost about as much as a 256-deep block of products) and walks the
    chunk's M blocks with the panel of B cached; tasks run chunk by chunk, so a thread's consecutive panels reuse
    its A chunk from L2 (M-long panels streamed all of A from L3 per panel: 1024 rows x K 3072 ran at 750 GFLOP/s).

    With an `epilogue` each block's C tiles are stored to a 4 KiB local block (rows 128 bytes apart: C's own rows,
    4 or 12 KiB apart at N = 1024 or 3072, share one L1 set) and the epilogue computes from it, 32 lanes at a time,
    one block behind: a slice of the previous block's rows per K step of the next, so its vector work overlaps the
    tile products (after them, a gelu epilogue added half the product's time), the task's last block after its own
    products. `TILE_PARAMS` records the geometry, so a pass can rebuild the kernel with an epilogue."""
    mt = 1 if rows < TILE_ROWS else C_ROWS
    nblocks, steps = np_ // (N_TILE * C_COLS), kp // K_STEP
    a_stride, c_stride = kp * 2, np_ * 4
    a0, b0 = mt * C_COLS, mt * C_COLS + mt  # first A and first B tile register
    b_step = 0 if shared_b else 1  # B's batch index per batch of A
    chunk = max(1, l2_bytes // 2 // (a_stride * rows * mt))  # M blocks of A in half of L2

    block_rows, block_cols = rows * mt, N_TILE * C_COLS
    lag = 0 if epilogue is None else 1  # an epilogue runs one block behind the products
    slice_rows = -(-block_rows // steps)  # rows of the previous block's epilogue per K step
    geometry = [rows, kp, np_, int(shared_b), cores, l2_bytes]

    @T.prim_func(private=True)
    def kernel(a_data: T.handle, w_data: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, TILE_PARAMS: geometry})
        batch, mp, wbatch = T.int64(), T.int64(), T.int64()
        a = T.match_buffer(a_data, (batch, mp, kp), "bfloat16")
        w = T.match_buffer(w_data, (wbatch, np_ // N_TILE, kp // PAIR, N_TILE), "uint32")  # bf16 pairs
        c = result_params(epilogue, batch, mp, np_)
        mblocks = mp // (rows * mt)
        spread = T.if_then_else(batch * nblocks < cores, (mblocks * batch * nblocks + cores - 1) // cores, mblocks)
        per_task = T.max(1, T.min(spread, chunk))  # 1 where M is 0: no task, and no division by zero
        tasks = (mblocks + per_task - 1) // per_task
        for task in T.parallel(tasks * batch * nblocks):  # chunks outer: a thread's run of panels shares A's chunk
            config = T.decl_buffer((TILE_CONFIG_BYTES,), "uint8", scope="local")
            for i in range(TILE_CONFIG_BYTES):
                config[i] = T.uint8(0)
            config[0] = T.uint8(1)  # palette 1
            for t in T.unroll(b0 + C_COLS):  # C and A tiles hold `rows` rows, B tiles 16 K pairs
                config[16 + 2 * t] = T.uint8(TILE_BYTES)
                config[48 + t] = T.uint8(T.if_then_else(t < b0, rows, TILE_ROWS))
            T.evaluate(_intrin("ldtilecfg", T.address_of(config[0])))
            nb = task % nblocks
            bb = task // nblocks % batch
            if epilogue is not None:
                acc = T.decl_buffer((2, block_rows, block_cols), "float32", scope="local")  # two blocks in turn
            first = task // (nblocks * batch) * per_task
            for mi in range(per_task + lag):
                mb = first + mi
                if mi < per_task and mb < mblocks:
                    for t in T.unroll(a0):
                        T.evaluate(_intrin("tilezero", T.uint8(t)))
                    for kb in range(steps):
                        for i in T.unroll(mt):
                            T.evaluate(_intrin("tileloadd64", T.uint8(a0 + i),
                                               T.address_of(a[bb, (mb * mt + i) * rows, kb * K_STEP]),
                                               T.int64(a_stride)))
                        for j in T.unroll(C_COLS):
                            T.evaluate(_intrin("tileloadd64", T.uint8(b0 + j),
                                               T.address_of(w[bb * b_step, nb * C_COLS + j, kb * TILE_ROWS, 0]),
                                               T.int64(TILE_BYTES)))
                        for i in T.unroll(mt):
                            for j in T.unroll(C_COLS):
                                T.evaluate(_intrin("tdpbf16ps", T.uint8(i * C_COLS + j), T.uint8(a0 + i),
                                                   T.uint8(b0 + j)))
                        if epilogue is not None:
                            if mi > 0:  # a slice of the previous block's rows while the tiles multiply
                                for r in range(slice_rows):
                                    if kb * slice_rows + r < block_rows:
                                        store_epilogue(
                                            epilogue, bb, (mb - 1) * block_rows + kb * slice_rows + r,
                                            nb * block_cols, block_cols, acc, [(mi - 1) % 2, kb * slice_rows + r, 0])
                    if epilogue is None:
                        for i in T.unroll(mt):
                            for j in T.unroll(C_COLS):
                                T.evaluate(_intrin("tilestored64", T.uint8(i * C_COLS + j), T.address_of(
                                    c[bb, (mb * mt + i) * rows, (nb * C_COLS + j) * N_TILE]), T.int64(c_stride)))
                    else:
                        for i in T.unroll(mt):
                            for j in T.unroll(C_COLS):
                                T.evaluate(_intrin("tilestored64", T.uint8(i * C_COLS + j), T.address_of(
                                    acc[mi % 2, i * rows, j * N_TILE]), T.int64(block_cols * 4)))
                if epilogue is not None:
                    if (mi == per_task or mb >= mblocks) and mi > 0 and mb - 1 < mblocks:  # the task's last block
                        for r in range(block_rows):
                            store_epilogue(epilogue, bb, (mb - 1) * block_rows + r, nb * block_cols, block_cols,
                                           acc, [(mi - 1) % 2, r, 0])
            T.evaluate(_intrin("tilerelease"))
    return kernel


def tile_rows(m: tirx.PrimExpr, tiles: bool) -> int:
    """The kernel's `rows` for M rows: on tiles, the rows of each A and C tile (M itself where it is known to be
    below 16, else 16); for `vdpbf16ps`, M where it is known (the most rows a register tile may take), else 0."""
    known = int(m) if isinstance(m, tirx.IntImm) else None
    if tiles:
        return known if known is not None and known < TILE_ROWS else TILE_ROWS
    return known if known is not None else 0


def padded(m: tirx.PrimExpr, k: int, n: int, tiles: bool) -> tuple[tirx.PrimExpr, int, int]:
    """(Mp, Kp, Np): the operand extents the kernel reads. Tiles read whole tiles of K and N and 32s of M from 16
    rows on; `vdpbf16ps` reads N in the same 32s (the register tile's vectors divide its panels), K only in whole
    pairs and M as it is (its last row tile moves back to end at M, or repeats M's last row in an M shorter than
    the tile)."""
    step = TILE_ROWS * C_ROWS
    mp = m if not tiles or tile_rows(m, tiles) < TILE_ROWS else (m + step - 1) // step * step
    return mp, _round_up(k, K_STEP if tiles else PAIR), _round_up(n, N_TILE * C_COLS)


def _unflattened(flat: tirx.PrimExpr, dims: list[tirx.PrimExpr]) -> list[tirx.PrimExpr]:
    """The row-major indices into `dims` of the flat index `flat`."""
    out = []
    for d in reversed(dims):
        out.append(flat % d)
        flat = flat // d
    return out[::-1]


def _flattened(indices: tuple[tirx.PrimExpr, ...], dims: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """The flat row-major index of `indices` into `dims` (the inverse of `_unflattened`)."""
    flat: tirx.PrimExpr = tirx.IntImm("int64", 0)
    for index, d in zip(indices, dims, strict=True):
        flat = flat * d + index
    return flat


def _within(value: tirx.PrimExpr, index: tirx.PrimExpr, extent: tirx.PrimExpr, padded_extent: tirx.PrimExpr,
            ) -> tirx.PrimExpr:
    """`value` where `index` < `extent`, else a zero; `value` alone where the padded extent is the extent."""
    if tvm.sym.Analyzer().can_prove_equal(extent, padded_extent):
        return value
    return tirx.if_then_else(index < extent, value, tirx.const(0, value.ty.dtype))


def _clamped(index: tirx.PrimExpr, extent: tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.min(index, extent - 1)


def _padded_bf16(x: te.Tensor, outer: int, rows: tirx.PrimExpr, cols: int) -> te.Tensor:
    """x [*batch, *m, K] (`outer` batch dims, then the dims that flatten to M) rounded to bf16 and zero-padded to
    [prod(batch), rows, cols]: A as the tiles read it, one elementwise kernel that FuseOps joins to x's producer
    (read in x's own shape, so no reshape stands between them)."""
    *lead, k = x.shape
    batch_dims, row_dims = list(lead[:outer]), list(lead[outer:])
    batch = element_count(batch_dims)
    m = element_count(row_dims)

    def element(b: tirx.PrimExpr, i: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        at = [*_unflattened(b, batch_dims), *_unflattened(_clamped(i, m), row_dims), _clamped(j, k)]
        value = _within(x[tuple(at)].astype("bfloat16"), j, k, cols)
        return _within(value, i, m, rows)
    return te.compute((batch, rows, cols), element, name="amx_operand")


def _packed_pairs(y: te.Tensor, kp: int, np_: int) -> te.Tensor:
    """y [*batch, K, N] rounded to bf16, zero-padded to [kp, np_] and packed as the tiles read B, written as uint32
    pairs [prod(batch), np_/16, kp/2, 16]: element (j, p, n) holds bf16(y[2p, 16j + n]) in its low half and
    bf16(y[2p + 1, 16j + n]) in its high half, which in memory is AMX's [np_/16, kp/2, 16, 2] bf16 pair layout.
    As pairs each store is one vector of 16 lanes from two contiguous runs of y (as 32 bf16 lanes, lane l read
    y[2p + l % 2, 16j + l // 2]: a gather); y's producer computes it where FuseOps joins them."""
    *lead, k, n = y.shape
    batch = element_count(lead)

    def half(b: tirx.PrimExpr, row: tirx.PrimExpr, col: tirx.PrimExpr) -> tirx.PrimExpr:
        value = y(*_unflattened(b, lead), _clamped(row, k), _clamped(col, n))
        return bf16_bits(_within(_within(value, row, k, kp), col, n, np_))

    def element(b: tirx.PrimExpr, j: tirx.PrimExpr, p: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
        col = j * N_TILE + c
        return half(b, p * PAIR, col) | (half(b, p * PAIR + 1, col) << tirx.const(16, "uint32"))
    return te.compute((batch, np_ // N_TILE, kp // PAIR, N_TILE), element, name="amx_packed")


def _unpadded(c: te.Tensor, outer: int, shape: list[tirx.PrimExpr]) -> te.Tensor:
    """C [batch, Mp, Np] without its padding, in the product's own shape [*batch, *m, n] (`outer` batch dims): one
    elementwise kernel FuseOps joins to the consumer (a slice and a reshape of symbolic extents would not fuse)."""
    batch_dims, row_dims = list(shape[:outer]), list(shape[outer:-1])

    def element(*at: tirx.PrimExpr) -> tirx.PrimExpr:
        return c[_flattened(at[:outer], batch_dims), _flattened(at[outer:-1], row_dims), at[-1]]
    return te.compute(shape, element, name="amx_result")


def _on_tiles(bb: relax.BlockBuilder, target: Target, x: relax.Expr, b: relax.Expr, outer: int, batch: tirx.PrimExpr,
              m: tirx.PrimExpr, k: int, n: int, shared_b: bool, shape: list[tirx.PrimExpr]) -> relax.Expr:
    """x @ B in the product's shape `shape` on tiles, for x [*batch, *m, k] f32 (`outer` batch dims) and B already
    packed [batch or 1, np_/16, kp/2, 16] (pairs): x's cast and padding in front, the kernel, and the copy dropping
    the padding (FuseOps joins it to the consumer). Where x is whole tiles its cast is elementwise and keeps x's
    shape, so FuseOps can put it in x's producer's epilogue (the FFN's gelu); where C is, a reshape (a view) is
    left."""
    tiles = has_tiles(target)
    mp, kp, np_ = padded(m, k, n, tiles)
    whole_rows = tvm.sym.Analyzer().can_prove_equal(mp, m)
    if whole_rows and kp == k:
        a = bb.emit(R.reshape(bb.emit(R.astype(x, "bfloat16")), [batch, m, k]))
    else:
        a = bb.call_te(_padded_bf16, x, outer, mp, kp)
    kernel = bb.add_func(*product_kernel(target, tile_rows(m, tiles), kp, np_, shared_b))
    out = bb.emit(relax.call_tir(kernel, [a, b], relax.TensorType((batch, mp, np_), "float32")))
    return R.reshape(out, shape) if whole_rows and np_ == n else bb.call_te(_unpadded, out, outer, shape)


def amx_matmul(call: OpCall) -> relax.Expr | None:
    """`x @ W` (bf16 operands, f32 sums) on AMX tiles for a bound f32 [K, N] W, for a CPU with AMX-BF16
    (`has_tiles` chooses); None where it does not apply (W not a constant, a symbolic K, a batched or
    transposed product). x's leading dims, symbolic or not, are the rows."""
    w = call.args[1]
    if not isinstance(w, tvm.ir.Constant) or call.types[1].rank != 2 or call.dtype(0) != "float32" \
            or call.dtype(1) != "float32":
        return None
    *lead, k = call.shape(0)
    if not isinstance(k, tirx.IntImm) or any(isinstance(d, tirx.IntImm) and int(d) == 0 for d in lead):
        return None
    k, n = int(k), int(call.types[1].shape[1])
    m = tvm.sym.Analyzer().simplify(element_count(lead))
    _, kp, np_ = padded(m, k, n, has_tiles(call.target))
    packed = call.bb.call_te(_packed_pairs, w, kp, np_)  # a constant: folded at build time
    one = tirx.IntImm("int64", 1)
    return _on_tiles(call.bb, call.target, call.args[0], packed, 0, one, m, k, n, True,
                     [*lead, tirx.IntImm("int64", n)])


def activation_product(bb: relax.BlockBuilder, x: relax.Expr, y: relax.Expr, target: Target) -> relax.Expr | None:
    """`x @ y` (bf16 operands, f32 sums) on the bf16 product kernel where both are float32 activations of the same
    leading dims (attention's `q @ k^T` and `p @ v`): y is cast, padded and packed by one elementwise kernel that
    FuseOps joins to y's producer, so the pack costs what writing y costs. None where it does not apply (rank below
    2, broadcast leading dims, a symbolic K or N, an empty dim)."""
    if x.ty.dtype != "float32" or y.ty.dtype != "float32" or x.ty.ndim < 2 or x.ty.ndim != y.ty.ndim:
        return None
    *lead, m, k = x.ty.shape.values
    *y_lead, _, n = y.ty.shape.values
    analyzer = tvm.sym.Analyzer()
    if not isinstance(k, tirx.IntImm) or not isinstance(n, tirx.IntImm) or int(k) == 0 or int(n) == 0 \
            or any(not analyzer.can_prove_equal(d, e) for d, e in zip(lead, y_lead, strict=True)) \
            or any(isinstance(d, tirx.IntImm) and int(d) == 0 for d in [*lead, m]):
        return None
    k, n = int(k), int(n)
    batch = analyzer.simplify(element_count(lead))
    _, kp, np_ = padded(m, k, n, has_tiles(target))
    b = bb.call_te(_packed_pairs, y, kp, np_)
    return _on_tiles(bb, target, x, b, len(lead), batch, m, k, n, False, [*lead, m, tirx.IntImm("int64", n)])
