"""Register-blocked CPU schedule for matmul, batch matmul and NCHW conv2d, with fused epilogues."""

import dataclasses
import math
from dataclasses import dataclass

import tvm_ffi
from tvm import ir, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..cpu import FMA_LATENCY, FMA_UNITS, CPUModel, cpu_model
from .injective import (
    cpu_blocks,
    largest_divisor,
    loop_extent,
    parallel_tasks,
    schedule_elementwise,
    split_factor,
    static_extent,
    stores_guarded,
    stride,
    uses_var,
)
from .padding_taps import map_share, skip_padding_taps

TILE_VECTORS = 2  # vectors across a register tile's columns: the rows then hold `CPUModel.accumulators / 2` sums
PANEL_SHARE = 8  # a panel of the vector operand takes 1/8 of L2 (128 KiB of Zen 4's 1 MiB), leaving room for the rest
MAX_STRIDE = 4  # the largest stride of the vector operand along C's last index the rule still vectorizes
PANEL_TILE_ROWS = 8  # a matmul streaming its operand in L2 panels uses at least this many rows per register tile
# Load bandwidth of x86 cores since Haswell and Zen (LLVM does not say; documented, like `cpu.FMA_UNITS`): two vector
# loads a cycle from L1, and about one vector a cycle from L2 (32 B on Zen, half of what L1 delivers elsewhere)
L1_LOADS_PER_CYCLE = 2
L2_VECTORS_PER_CYCLE = 1
ROW_CHUNK_SHARE = 4  # a chunk of a conv's pixels takes at most 1/4 of L2 with its input slab (`_row_chunks`)
CHANNEL_CHUNK_BLOCKS = 8  # input-channel blocks (one memory stream each) a 1x1 conv's chunk of channels reads at once


@dataclass(frozen=True)
class _Contraction:
    """Roles of the loops of a `C[..] += A[..] * B[..]` block."""

    vector: s_tir.schedule.LoopRV  # indexes C's last dimension and, with stride 1, the vector operand
    row: s_tir.schedule.LoopRV | None  # innermost other C index the vector operand ignores
    spatial: list[s_tir.schedule.LoopRV]  # remaining spatial loops, outermost first
    reduction: list[s_tir.schedule.LoopRV]
    line: s_tir.schedule.LoopRV | None = None  # innermost of `spatial` only the vector operand walks (conv rows)
    # a loop of `spatial` only the other operand walks, at stride 1 beside a reduction loop (`oh + kh`): a stride-1
    # window conv's output rows, which a blocked conv's register tile may span
    height: s_tir.schedule.LoopRV | None = None
    vector_var: tirx.Var | None = None  # the block iterator of `vector`
    stride: int = 1  # of the vector operand along `vector`: above 1 in a strided conv
    panel: int | None = None  # the panel width of a packed vector operand read `B[j // w, .., j % w]` (`matmul_layout`)
    # the vector operand walks no spatial loop but `line` and `vector`, and its vectors no reduction loop (a blocked
    # conv's weight: the same vectors for every pixel and image), unlike an NCHW conv's input (`x[b, c, i + ky, j + kx]`
    # walks the batch and its vectors the window)
    weight_vectors: bool = False
    # the share of the products over `height` and the kernel rows that read the map, not its zero padding
    # (`padding_taps.map_share`): what a register tile within one output row computes, the rest skipped
    map_rows: float = 1.0


Indices = list[tirx.Expr]


def _load(expr: tirx.Expr) -> ir.TensorLoad | None:
    """The buffer load under an optional cast, or in the `then` branch of a padding guard
    (`if_then_else(i < n, A[i, k], 0)`, which `pad_einsum` leaves once its producer is inlined)."""
    if isinstance(expr, tirx.Cast):
        expr = expr.value
    if isinstance(expr, ir.Call) and getattr(expr.op, "name", "") == "prim.if_then_else":
        expr = expr.args[1]
    return expr if isinstance(expr, ir.TensorLoad) else None


def _decoded(stmt: s_tir.SBlock, known: list[tirx.Buffer]) -> Indices | None:
    """The indices of a factor computed from loads (a weight decoded from codes and scales in the kernel): those of
    the widest point read of the block outside the `known` buffers, the codes, which set its access pattern."""
    reads = [r for r in stmt.reads if not any(r.source.same_as(b) for b in known)]
    widest = max(reads, key=lambda r: len(r.region), default=None)
    if widest is None or not all(isinstance(rg.extent, tirx.IntImm) and rg.extent.value == 1 for rg in widest.region):
        return None
    return [rg.min for rg in widest.region]


def _operands(stmt: s_tir.SBlock) -> tuple[tirx.BufferStore, Indices, Indices] | None:
    """The store and the indices of both factors when the block body is `C[idx] = C[idx] + A[..] * B[..]` (one of
    A and B may be decoded from other loads)."""
    store = stmt.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    acc, prod = store.value.a, store.value.b
    if isinstance(acc, tirx.Mul):
        acc, prod = prod, acc
    if not isinstance(acc, ir.TensorLoad) or not acc.source.same_as(store.buffer):
        return None
    if not isinstance(prod, tirx.Mul):
        return None
    lhs, rhs = _load(prod.a), _load(prod.b)
    if lhs is None and rhs is None:
        return None
    plain = [load.source for load in (lhs, rhs) if load is not None]
    factors = [list(load.indices) if load is not None else _decoded(stmt, [store.buffer, *plain])
               for load in (lhs, rhs)]
    if factors[0] is None or factors[1] is None:
        return None
    return store, factors[0], factors[1]


def _fuse_into_store(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, result: tirx.Buffer) -> bool:
    """Reverse-inline an epilogue block into the block storing `result`; False if it cannot be.

    Only blocks that iterate exactly over `result` and read it at their own iteration point qualify:
    on a broadcasting epilogue reverse_compute_inline can fail with an internal error rather than a
    ScheduleError. A unit dim of `result` read at 0 needs no iterator (a batch-1 layer's bias and relu).
    """
    stmt = sch.get(block)
    iter_vars = [iv.var for iv in stmt.iter_vars]
    regions = [[r for r, size in zip(access.region, result.shape, strict=True)
                if not (static_extent(size) == 1 and isinstance(r.min, tirx.IntImm) and r.min.value == 0)]
               for access in stmt.reads if access.source.same_as(result)]
    pointwise = all(
        len(region) == len(iter_vars) and all(r.min.same_as(v) for r, v in zip(region, iter_vars))
        for region in regions
    )
    if not regions or not pointwise:
        return False
    try:
        sch.reverse_compute_inline(block)
    except s_tir.ScheduleError:
        return False
    return True


def _match(sch: s_tir.Schedule, info: dl.SBlockInfo) -> _Contraction | None:
    """Assign loop roles for a multiply-accumulate block, or None when it is not one we can block."""
    if any(kind not in "SR" for kind in info.dom_kind()):
        return None
    found = _operands(sch.get(info.block_rv))
    if found is None:
        return None
    store, lhs, rhs = found
    spatial = [it for it in info.iters if it.kind == "S"]
    vec = next((it for it in spatial if it.var.same_as(store.indices[-1])), None)
    if vec is None:
        return None
    # the vector operand walks C's last index with stride 1 (matmul, conv), else with a small constant stride (a
    # strided conv: `_split_phases` stores that operand phase by phase so it is read with stride 1 after all)
    pairs = [(s, vec_op, other) for vec_op, other in ((lhs, rhs), (rhs, lhs))
             if not any(uses_var(e, vec.var) for e in other)
             and (s := 1 if _panel_width(vec_op[-1], vec.var) else stride(vec_op[-1], vec.var)) is not None
             and 1 <= s <= MAX_STRIDE]
    if not pairs:
        return None
    step, vec_op, other = min(pairs, key=lambda p: p[0])
    panel = _panel_width(vec_op[-1], vec.var)
    row = next(
        (
            it
            for idx in reversed(list(store.indices[:-1]))
            for it in spatial
            if it.var.same_as(idx)
            and not any(uses_var(e, it.var) for e in vec_op)
            and any(uses_var(e, it.var) for e in other)
        ),
        None,
    )
    rest = [it for it in spatial if it is not vec and it is not row]
    line = next((it for it in reversed(rest) if any(uses_var(e, it.var) for e in vec_op)
                 and not any(uses_var(e, it.var) for e in other)), None)
    reduction = [it for it in info.iters if it.kind == "R"]
    height = next((it for it in reversed(rest) if it is not line and not any(uses_var(e, it.var) for e in vec_op)
                   and any(stride(e, it.var) == 1 and any(uses_var(e, r.var) for r in reduction) for e in other)), None)
    return _Contraction(
        vector=vec.loop_rv,
        row=None if row is None else row.loop_rv,
        spatial=[it.loop_rv for it in rest],
        reduction=[it.loop_rv for it in reduction],
        line=None if line is None else line.loop_rv,
        height=None if height is None or line is None else height.loop_rv,
        vector_var=vec.var,
        stride=step,
        panel=panel,
        weight_vectors=line is not None and not any(uses_var(vec_op[-1], r.var) for r in reduction)
        and not any(uses_var(e, it.var) for e in vec_op for it in rest if it is not line),
    )


def _vectorize_by_vector(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, lanes: int | None) -> None:
    """Vectorize a register tile's column loop one machine vector at a time (an unrolled loop of `lanes`-wide
    vectors) where it spans several whole ones. LLVM legalizes a vector of 3, 5, 6 or 7 machine vectors (48, 80,
    96, 112 lanes on AVX-512) through per-lane inserts and stack slots: over 4 x 256 x 4w, 48 to 112 columns ran
    at 24-36 GFLOP/s where 64 and 128 ran at 100-150, and a 5 x 768 x 768 linear (a 48-wide tile) took 0.19 ms,
    0.035 split (Zen 4). Tiles of 2 or 4 vectors build to the same instructions either way."""
    extent = static_extent(loop_extent(sch, loop))
    if lanes and extent is not None and extent > lanes and extent % lanes == 0:
        vectors, loop = sch.split(loop, [None, lanes])
        sch.unroll(vectors)
    sch.vectorize(loop)


def _panel_width(expr: tirx.Expr, var: tirx.Var) -> int | None:
    """w where `expr` is `var % w` for a constant w: the last index of a weight packed in panels of w columns."""
    if isinstance(expr, tirx.FloorMod) and expr.a.same_as(var) and isinstance(expr.b, tirx.IntImm):
        return int(expr.b.value)
    return None


def _phases(step: int, ndim: int) -> tirx.IndexMap:
    """The index map splitting the last of `ndim` dimensions into `step` phases: `w -> (w % step, w // step)`."""
    return tirx.IndexMap.from_func(lambda *idx: (*idx[:-1], idx[-1] % step, idx[-1] // step), ndim=ndim)


def _split_phases(sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, roles: _Contraction) -> bool:
    """Store the vector operand of a strided contraction phase by phase, so the kernel reads it with stride 1;
    True if it did.

    A conv of stride s reads `x[.., ow * s + kw]`: vectors along `ow` would be strided gathers (the 3x3/2 conv ran
    at 1% of peak). Its padded input (or a copy of the input, when there is no padding) is laid out as
    `x'[.., w % s, w // s]` instead, so the kernel reads `x'[.., kw % s, ow + kw // s]` and runs as the stride-1
    conv does; the copy costs one pass over the input. A width that is no multiple of s keeps the gathers (TVM's
    `transform_layout` with a `pad_value` left unbound loop variables in such a kernel).
    """
    if roles.stride == 1 or roles.vector_var is None:
        return False
    stmt = sch.get(main)
    index = next(i for i, r in enumerate(stmt.reads) if stride(r.region[-1].min, roles.vector_var) == roles.stride)
    source = stmt.reads[index].source
    width = static_extent(source.shape[-1])
    if width is None or width % roles.stride:
        return False
    producer = next((b for b in sch.get_producers(main) if sch.get(b).writes[0].source.same_as(source)), None)
    if producer is None:
        producer = sch.cache_read(main, index, "global")
    sch.transform_layout(producer, ("write", 0), _phases(roles.stride, len(source.shape)))
    sch.transform_block_layout(producer, _phases(roles.stride, len(sch.get(producer).iter_vars)))
    return True


def _operand_bytes(stmt: s_tir.SBlock, vector_var: tirx.Var) -> tuple[int, int] | None:
    """Bytes of a contraction's (vector operand, other operand) buffers, per image: of the block's two reads beside
    the accumulator, the one indexed by `vector_var` first, a symbolic leading dim (a dynamic batch) counted once;
    None where there are other reads or another dim is symbolic."""
    result = stmt.writes[0].source
    factors = [r for r in stmt.reads if not r.source.same_as(result)]
    if len(factors) != 2:
        return None
    if not any(uses_var(rg.min, vector_var) for rg in factors[0].region):
        factors.reverse()
    sizes = [[static_extent(d) for d in r.source.shape] for r in factors]
    sizes = [[1 if i == 0 and n is None else n for i, n in enumerate(size)] for size in sizes]
    if any(None in size for size in sizes):
        return None
    vector, other = (math.prod(size) * r.source.dtype.bits // 8 for size, r in zip(sizes, factors, strict=True))
    return vector, other


def _schedule_padding(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Parallel rows, and the innermost loop split by TVM's loop partitioning at the guard's bounds: the border
    elements store zeros, the interior copies without a branch (which LLVM vectorizes). Vectorized as one loop,
    the guard made every lane a scalar branch: the padding of a 96x56x56 depthwise conv took half its time."""
    *outer, inner = sch.get_loops(block)
    if outer:
        parallel_tasks(sch, outer)
    sch.annotate(inner, "pragma_loop_partition_hint", 1)


def _sums_wider(sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, epilogue: list[s_tir.schedule.SBlockRV]) -> bool:
    """Whether the contraction sums more columns (a packed weight's zero-padded last panel) or rows (`padded_rows`)
    than its last epilogue stores: that epilogue is then computed at the register tile with its own bounds, as after
    `_pad_tails` (inlined into the tile's store instead, its column guard replaced the store's row guard, and a row
    tail wrote past C). The other dims, a symbolic batch among them, must be the same."""
    if not epilogue:
        return False
    sums, out = (sch.get(b).writes[0].source.shape for b in (main, epilogue[-1]))
    if len(sums) != len(out) or not all(_same_dim(s, o) for s, o in zip(sums[:-2], out[:-2])):
        return False
    wider = False
    for s, o in zip(sums[-2:], out[-2:]):
        if _same_dim(s, o):
            continue
        s, o = static_extent(s), static_extent(o)
        if s is None or o is None or o > s:
            return False
        wider = True
    return wider


def _same_dim(a: tirx.Expr, b: tirx.Expr) -> bool:
    """Whether two buffer dims are the same extent: equal constants (of any integer type), or the same expression."""
    constant = static_extent(a)
    return constant == static_extent(b) if constant is not None else tvm_ffi.structural_equal(a, b)


def _broadcast_read(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """Whether a consumer of `block` writes more elements than it (a symbolic dim counted once on both sides):
    inlined there, `block` would be computed again for every element of the consumer. A squeeze-excite's gate
    `sigmoid(conv + bias)`, fused with its product with the whole map, took an exp per pixel of the map (the zoo's
    EfficientNet at batch 8 ran 0.55 ms against 0.43 with the gate computed once per channel)."""
    def elements(b: s_tir.schedule.SBlockRV) -> int:
        return math.prod(static_extent(d) or 1 for d in sch.get(b).writes[0].source.shape)

    return any(elements(c) > elements(block) for c in sch.get_consumers(block))


def _row_count(sch: s_tir.Schedule, roles: _Contraction) -> int | None:
    """The rows of C: 1 without a row loop (a GEMV), its static extent, or None when it is symbolic (a dynamic
    batch)."""
    return 1 if roles.row is None else static_extent(loop_extent(sch, roles.row))


class CPUMatmul(dl.ScheduleRule):
    """Block an `mr x nr` tile of C in registers, unroll K by `k_unroll`, fuse epilogues into the store.

    Applies to PrimFuncs with exactly one reduction block of the form `C[..] += A[..] * B[..]` whose
    last output index walks one factor with stride 1 (the "vector" operand), or up to `MAX_STRIDE`: matmul, batch
    matmul with broadcasting, matmuls reading A transposed (as in backward passes) and NCHW conv2d, strided,
    dilated and depthwise ones too. Tile
    sizes fall back to divisors or whole extents for odd shapes and to predicated tails for symbolic
    ones. Inputs computed in the same kernel (conv padding) are materialized and scheduled separately, and the
    products with a conv's zero padding are skipped where the loops allow (`padding_taps.py`).

    A parameter left None comes from the target CPU's model (`for_cpu`): on AVX-512 (32 x 16 lanes) an 8 x 32
    tile and 128 KiB panels of a 1 MiB L2, on AVX2 (16 x 8 lanes) 4 x 16 and an eighth of its L2. A vector operand
    packed in panels (`matmul_layout.py`, read `B[j // w, k, j % w]`) sets the vector tile to w and the rows to
    `packed_rows` (`registers`: the vector register file).
    """

    def __init__(self, mr: int | None = None, nr: int | None = None, k_unroll: int = 4,
                 panel_bytes: int | None = None, accumulators: int | None = None, lanes: int | None = None,
                 registers: int | None = None, l1_bytes: int | None = None, latency_sums: int | None = None,
                 l2_bytes: int | None = None, cores: int | None = None) -> None:
        self.mr, self.nr, self.k_unroll, self.panel_bytes = mr, nr, k_unroll, panel_bytes
        self.accumulators, self.lanes, self.registers, self.l1_bytes = accumulators, lanes, registers, l1_bytes
        self.latency_sums, self.l2_bytes, self.cores = latency_sums, l2_bytes, cores

    def for_cpu(self, model: CPUModel) -> "CPUMatmul":
        """This rule with every parameter it leaves None taken from `model`: `TILE_VECTORS` vectors wide, as many
        rows as `model.accumulators` allows, panels of `1 / PANEL_SHARE` of L2."""
        accumulators = self.accumulators or model.accumulators
        return CPUMatmul(self.mr or max(1, accumulators // TILE_VECTORS), self.nr or TILE_VECTORS * model.lanes(),
                         self.k_unroll, self.panel_bytes or model.caches.l2 // PANEL_SHARE, accumulators,
                         self.lanes or model.lanes(), self.registers or model.vector_registers,
                         self.l1_bytes or model.caches.l1d, self.latency_sums or model.latency_sums,
                         self.l2_bytes or model.caches.l2, self.cores or model.cores)

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if None in (self.mr, self.nr, self.panel_bytes, self.accumulators, self.lanes, self.registers, self.l1_bytes,
                    self.latency_sums, self.l2_bytes, self.cores):
            return self.for_cpu(cpu_model(target)).apply(func, target, tunable)
        sch, infos = cpu_blocks(func, target)
        if infos is None:
            return None
        reductions = [info for info in infos if info.is_reduction()]
        if len(reductions) != 1:
            return None
        roles = _match(sch, reductions[0])
        if roles is None:
            return None
        padded = self._pad_tails(sch, reductions[0], roles)
        if padded or _split_phases(sch, reductions[0].block_rv, roles):
            infos = dl.normalize_prim_func(sch)
            reductions = [info for info in infos or [] if info.is_reduction()]
            roles = _match(sch, reductions[0]) if len(reductions) == 1 else None
            if roles is None:
                return None
        main = reductions[0].block_rv
        producers = sch.get_producers(main)
        epilogue = self._inline_side_blocks(sch, infos, main, producers)
        padding = [block for block in producers if stores_guarded(sch.get(block))]
        if len(padding) == 1 and roles.height is not None:
            roles = dataclasses.replace(roles, map_rows=map_share(sch, main, padding[0], roles.height))
        self._block_contraction(sch, main, roles, epilogue, padded or _sums_wider(sch, main, epilogue))
        for block in producers:
            if block in padding:
                _schedule_padding(sch, block)
            else:
                schedule_elementwise(sch, block, self.lanes)
        return s_tir.Schedule(skip_padding_taps(sch, main, padding[0])) if len(padding) == 1 else sch

    def vector_tile(self, extent: tirx.Expr, rows: int | None = None) -> int:
        """Columns of C in one register tile: `tile_width`, or a divisor of the extent of at least 8 that is one
        vector at most or a whole number of them. LLVM splits a vector of 28 lanes on a 16-lane CPU into shuffles and
        spills: an NCHW 3x3 conv over a 28-wide map ran 6x slower per FMA than over a 32-wide one on an AVX-512 core,
        and in tiles of 14 columns (one vector) 5x faster than in tiles of 28."""
        tile, count = split_factor(extent, self.tile_width(rows), 8), static_extent(extent)
        lanes = self.lanes or tile
        if count is None or tile <= lanes or tile % lanes == 0:
            return tile
        return largest_divisor(count, lanes)

    def tile_width(self, rows: int | None = None) -> int:
        """Columns of C the register tile takes where the extent needs no divisor (a weight packed in padded panels).

        A matmul of fewer than `mr` rows (`rows`: a GEMV at batch 1) widens the tile to as many vectors as its rows
        leave accumulators for: at 1 x `nr` only `TILE_VECTORS` sums are in flight, too few to hide the FMA
        latency, and the 1x784x512 layer ran at 13% of peak (13.6 GB/s of weight) on a Zen 3 core.
        """
        if rows is not None and 0 < rows < self.mr:
            return max(self.nr, self.lanes * (self.accumulators // rows))
        return self.nr

    def packed_rows(self, vectors: int) -> int:
        """Rows of a register tile over a packed operand `vectors` vectors wide: as many as leave room in the vector
        register file for the tile's sums, the operand's vectors of one k step and one broadcast (6 x 16 on AVX2,
        14 x 32 on AVX-512), so no sum is spilled."""
        return max(1, (self.registers - vectors - 1) // vectors)

    def padded_rows(self, rows: int, width: int) -> int:
        """Rows of C a matmul over an operand packed in panels `width` wide sums: `rows`, or, where more than one
        register tile takes them and no tile of 4 to `packed_rows` rows divides them (197 tokens, a prime), the
        fewest rows past them that such a tile divides (198 = 18 x 11). The rows past `rows` repeat the last row of A
        and are never stored, so the tile has no guard: with a predicated last tile the 48x197x197x64 context matmul
        ran at 21% of peak. Rounded up to whole tiles of 14 instead (210), the 197x3072x768 layer summed 6.6% more
        and lost 7% against the predicated tail."""
        tile = self.packed_rows(-(-width // (self.lanes or 1)))
        if not self._ragged(tirx.IntImm("int64", rows), tile, 4):
            return rows
        return min(-(-rows // t) * t for t in range(4, tile + 1))

    def _packed_tile_rows(self, roles: _Contraction) -> int | None:
        """`packed_rows` for the panel of a packed vector operand; None when the operand is not packed."""
        if roles.panel is None or roles.row is None:
            return None
        return self.packed_rows(-(-roles.panel // self.lanes))

    def _pad_tails(self, sch: s_tir.Schedule, info: dl.SBlockInfo, roles: _Contraction) -> bool:
        """Pad a symbolic row extent (a dynamic batch) to a multiple of `mr`, and the columns of a batched matmul
        whose width no tile divides (attention's 197) to a multiple of `nr`; True if it padded.

        Columns: a vector tile with a predicated tail is not vectorized, so the 48x197x64x197 attention matmul ran
        at 2 GFLOP/s (24x onnxruntime); padded, the B copy and a guarded store cost one pass over B and C each and
        it ran at 21-27 (2.1x). Unbatched matmuls keep their tail (their epilogue stays in the register store),
        except a width between one vector and `nr` that is no multiple of the vector (an MLP's 10 outputs: 8 + a
        2-lane vector built element by element) under at least `mr` rows, which pay for the B copy: 256x512x10 ran
        0.159 -> 0.068 ms, 7x1000x10 0.017 -> 0.007 (Zen 3, one core).

        Splitting the symbolic loop directly guards the tail with a predicate on every block of the
        tile, and TVM's buffer compaction then cannot shrink the accumulator below the whole symbolic
        extent (an `(n, nr)` local buffer in memory instead of an `mr x nr` register tile). Padding the
        iteration domain instead makes the split exact: the input rows are copied once into a buffer padded
        with zero rows (a producer kernel, scheduled like the others), so the inner loop reads without guards,
        and only the epilogue that writes the real output keeps a predicate. Inlining that copy as a guarded
        load instead left the dynamic-batch MLP 1.27x slower than the static build; the copy makes it 1.04x.
        """
        factors = {}
        if _row_count(sch, roles) is None and not roles.weight_vectors:  # (a blocked conv's take 1-row tiles)
            factors[roles.row] = self.mr
        batch = [static_extent(loop_extent(sch, loop)) for loop in roles.spatial]
        width = static_extent(loop_extent(sch, roles.vector))
        rows = _row_count(sch, roles)
        if (roles.line is None and None not in batch and (math.prod(batch) > 1
                and self._ragged(loop_extent(sch, roles.vector), self.nr, 8)
                or width is not None and self.lanes < width < self.nr and width % self.lanes
                and rows is not None and rows >= self.mr)):
            factors[roles.vector] = self.nr
        if not factors:
            return False
        padding = [next((f for loop, f in factors.items() if it.loop_rv.same_as(loop)), 1) for it in info.iters]
        if sum(f > 1 for f in padding) != len(factors):
            return False
        try:
            sch.pad_einsum(info.block_rv, padding)
        except s_tir.ScheduleError:
            return False
        return True

    @staticmethod
    def _ragged(extent: tirx.Expr, tile: int, minimum: int) -> bool:
        """Whether tiling `extent` by `split_factor(extent, tile, minimum)` leaves a predicated tail."""
        n = static_extent(extent)
        return n is None or n > tile and n % split_factor(extent, tile, minimum) != 0

    @staticmethod
    def _inline_side_blocks(
        sch: s_tir.Schedule,
        infos: list[dl.SBlockInfo],
        main: s_tir.schedule.SBlockRV,
        producers: list[s_tir.schedule.SBlockRV],
    ) -> list[s_tir.schedule.SBlockRV]:
        """Inline every block that is neither the contraction nor one of its inputs; return the rest.

        Inputs stay materialized (inlining padding or a transpose into the inner loop would put
        branches or strided loads there). Intermediate epilogue blocks must be inlined into their
        consumers before the last one is reverse-inlined, or a value read twice (gelu) loses its
        definition.
        """
        kept = {sch.get(b).name_hint for b in [main, *producers]}
        rest = []
        for info in infos:
            if sch.get(info.block_rv).name_hint in kept:
                continue
            if _broadcast_read(sch, info.block_rv):
                rest.append(info.block_rv)
                continue
            try:
                sch.compute_inline(info.block_rv)
            except s_tir.ScheduleError:
                rest.append(info.block_rv)
        return rest

    def _block_contraction(
        self,
        sch: s_tir.Schedule,
        main: s_tir.schedule.SBlockRV,
        roles: _Contraction,
        epilogue: list[s_tir.schedule.SBlockRV],
        padded: bool = False,
    ) -> None:
        """Tile, reorder, cache the accumulator in registers, fuse the epilogue and annotate loops."""
        rows = None if roles.line is not None else _row_count(sch, roles)  # of C in the register tile
        width = roles.panel or self.vector_tile(loop_extent(sch, roles.vector), rows)
        vec_o, vec_i = sch.split(roles.vector, [None, width])
        panel, vec_o = self._column_panels(sch, main, roles, vec_o, vec_i)
        rows, lines, heights = self._tile_shape(sch, roles, static_extent(loop_extent(sch, vec_i)), bool(panel))
        row_tile: list[s_tir.schedule.LoopRV] = []
        row_inner: list[s_tir.schedule.LoopRV] = []
        if roles.row is not None:
            row_o, row_i = sch.split(roles.row, [None, rows])
            row_tile, row_inner = [row_o], [row_i]
        spatial, line_inner = roles.spatial, []
        line_o = None
        if lines > 1:
            line_o, line_i = sch.split(roles.line, [None, lines])
            spatial, line_inner = [line_o if loop is roles.line else loop for loop in roles.spatial], [line_i]
        if heights > 1:
            height_o, height_i = sch.split(roles.height, [None, heights])
            spatial = [height_o if loop is roles.height else loop for loop in spatial]
            row_inner = [height_i, *row_inner]
        *red_outer, red_last = roles.reduction
        k_o, k_i = sch.split(red_last, [None, split_factor(loop_extent(sch, red_last), self.k_unroll)])
        chunk: list[s_tir.schedule.LoopRV] = []
        line = line_o if lines > 1 else roles.line
        if line is not None and self._split_pixels(sch, main, roles):
            # the line loop between chunks of pixels and the tiles of a chunk
            spatial = [loop for loop in spatial if loop is not line]
            spatial, chunk, row_tile, k_o = self._pixel_sweep(sch, main, spatial, line, row_tile, rows, lines,
                                                              [*red_outer, k_o, k_i], vec_i)
        sch.reorder(*panel, *spatial, *chunk, *row_tile, vec_o, *red_outer, k_o, k_i, *row_inner, *line_inner, vec_i)

        store = sch.cache_write(main, 0, "local")
        sch.reverse_compute_at(store, spatial[-1] if chunk else vec_o, preserve_unit_loops=True)
        result = sch.get(store).writes[0].source
        if padded:
            # The epilogue covers only the real rows: compute it at the tile (with the tail predicate)
            # and let it read the accumulator directly, so the padded result is never materialized.
            *others, last = epilogue
            for block in others:
                schedule_elementwise(sch, block, self.lanes)
            sch.reverse_compute_at(last, vec_o, preserve_unit_loops=True)
            sch.compute_inline(store)
            store = last
        else:
            for block in epilogue:
                if not _fuse_into_store(sch, block, result):
                    schedule_elementwise(sch, block, self.lanes)

        sch.parallel(sch.fuse(*panel, *spatial) if chunk else sch.fuse(*panel, *spatial, *row_tile, vec_o))
        for loop in [k_i, *row_inner, *line_inner]:
            sch.unroll(loop)
        _vectorize_by_vector(sch, vec_i, self.lanes)
        _vectorize_by_vector(sch, sch.get_loops(store)[-1], self.lanes)
        init = sch.decompose_reduction(main, chunk[0] if chunk else red_outer[0] if red_outer else k_o)
        _vectorize_by_vector(sch, sch.get_loops(init)[-1], self.lanes)

    def _split_pixels(self, sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, roles: _Contraction) -> bool:
        """Whether a conv's threads should split its output pixels rather than its lines (output-channel vectors).
        Split by lines, each thread reads all of the input for its share of the weight; by pixels, its share of the
        input and all of the weight. So by pixels where the input (the other operand) outweighs the weight (the
        vector operand), and, on more than one core, where the kernel pads its input itself and every core can keep
        the whole weight in half of its L2.

        2 threads on an Emerald Rapids VM, by lines / by pixels: 3x3 64x56² 0.69-0.70 / 0.63 ms (861 KB of padded
        input, 147 KB of weight); 1x1 64x56² and 128x28², 3x3/2 64x56² level. Split by pixels regardless, the
        weight-heavy convs lost: 3x3/2 256x14² (2.4 MB of weight) 0.150 -> 0.219 ms, 512x7² 0.33 -> 0.47. A padded
        conv reads the padded copy its threads have just written (each thread half of it): by lines each thread
        reads all of it, and 3x3 128x28² (590 KB of weight) took 0.66-0.75 ms where the same conv over a padded
        input written once took 0.56-0.61; by pixels 0.89-0.96x the time, and 3x3/2 128x28², bimodal by lines
        (0.20 or 0.26-0.30 ms), 0.68-0.91x. Unpadded 1x1 convs with 1 MB of weight lost 6% by pixels, and one thread
        lost 7% on 3x3 128x28² (medians of 7 interleaved rounds, session 20)."""
        sizes = _operand_bytes(sch.get(main), roles.vector_var)
        if sizes is None:
            return False
        weight, image = sizes
        pads = any(stores_guarded(sch.get(block)) for block in sch.get_producers(main))
        return image > weight or (self.cores > 1 and pads and weight <= self.l2_bytes // 2)

    def _pixel_sweep(self, sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, spatial: list[s_tir.schedule.LoopRV],
                     line: s_tir.schedule.LoopRV, row_tile: list[s_tir.schedule.LoopRV], rows: int, lines: int,
                     reduction: list[s_tir.schedule.LoopRV], vec_i: s_tir.schedule.LoopRV
                     ) -> tuple[list[s_tir.schedule.LoopRV], list[s_tir.schedule.LoopRV], list[s_tir.schedule.LoopRV],
                                s_tir.schedule.LoopRV]:
        """(spatial, chunk, row tiles, innermost-but-one reduction loop) of a conv whose threads split its pixels:
        chunks of pixels (`_row_chunks`), each swept one line after another. A 1x1 conv over more input channels than
        `CHANNEL_CHUNK_BLOCKS` blocks also sums them in chunks of that many blocks outside the tiles of a chunk of
        pixels, its sums in half of L1 between them: every tile otherwise read one 64-byte line from each of the
        input's channel blocks (16 streams for 256 channels), whose misses the core could not overlap once the map
        was beyond L3. At batch 8 on Zen 4 the 256 -> 64 conv at 56² took 6.3 ms, 4.6 in chunks of 8 blocks
        (onnxruntime 4.3), and 512 -> 128 at 28² 5.2 and 4.1; chunks of 4 or 16 blocks, or sums in all of L1,
        were slower."""
        *red_outer, k_o, k_i = reduction
        step = static_extent(loop_extent(sch, k_i)) or 1
        depth = (static_extent(loop_extent(sch, k_o)) or 0) * step
        channels = CHANNEL_CHUNK_BLOCKS * self.lanes
        by_channels = not red_outer and depth > channels and channels % step == 0 and depth % channels == 0
        width = (static_extent(loop_extent(sch, vec_i)) or self.lanes) * sch.get(main).writes[0].source.dtype.bits // 8
        sums = rows * lines * width if by_channels else None
        chunk, tiles = self._row_chunks(sch, main, row_tile, rows, reduction, sums)
        if by_channels and chunk is not None:
            channel_chunk, k_o = sch.split(k_o, [None, channels // step])
            return [*spatial, chunk, line], [channel_chunk], [tiles], k_o
        return spatial, [], [loop for loop in (chunk, line, tiles) if loop is not None], k_o

    def _row_chunks(self, sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, row_tile: list[s_tir.schedule.LoopRV],
                    rows: int, reduction: list[s_tir.schedule.LoopRV], sums: int | None = None
                    ) -> tuple[s_tir.schedule.LoopRV | None, s_tir.schedule.LoopRV | None]:
        """The row-tile loop of a conv whose threads split its pixels, split into (chunks, tiles of a chunk) so the
        line loop can go between them: a chunk's slab of the input takes at most `1 / ROW_CHUNK_SHARE` of L2 and
        every line reuses it from there, and each line writes (and, with a residual, reads) a run of whole chunks.
        With the lines innermost, every row tile of a 1x1 conv touched all output-channel blocks of the map, 16 to
        32 concurrent streams of 512 bytes each, and at batch 8 (maps beyond L3) the 64 -> 256 conv with a residual
        at 56² ran at 92 GFLOP/s, the tiles computing 200 elsewhere. At least `cores` chunks per image, so that a
        single image still gives every core its own pixels, and a number of them the cores divide where one does, so
        no chunk is shared. (None, the row-tile loop or None) where there is no static extent to split."""
        if not row_tile:
            return None, None
        tiles = static_extent(loop_extent(sch, row_tile[0]))
        depth = [static_extent(loop_extent(sch, loop)) for loop in reduction]
        if tiles is None or None in depth or tiles < 2:
            return None, row_tile[0]
        tile_bytes = rows * math.prod(depth) * sch.get(main).writes[0].source.dtype.bits // 8
        fit = max(1, self.l2_bytes // ROW_CHUNK_SHARE // max(1, tile_bytes))
        if sums is not None:  # the chunk's sums stay in half of L1 between chunks of input channels
            fit = min(fit, max(1, self.l1_bytes // 2 // sums))
        sizes = [d for d in range(1, min(fit, max(1, tiles // self.cores)) + 1) if tiles % d == 0]
        per_chunk = max(sizes, key=lambda d: (tiles // d % self.cores == 0, d))  # each core whole chunks, if it can
        chunk, tile = sch.split(row_tile[0], [None, per_chunk])
        return chunk, tile

    def _tile_shape(self, sch: s_tir.Schedule, roles: _Contraction, width: int | None, panelled: bool = False
                    ) -> tuple[int, int, int]:
        """(rows, lines, heights) of the register tile: `mr` rows of C (or `mr / 2`; fewer for short extents) by the
        vector tile, times a few output rows of the vector operand where it has a `line` loop (a conv's output rows);
        a blocked conv (`weight_vectors`: 1x1, strided and window) takes `_window_tile`'s where its line and height
        extents are static, which for a stride-1 window conv may span `heights` output rows.

        A matmul whose vector operand streams from L2 in panels takes at least `PANEL_TILE_ROWS` rows: every row
        tile re-reads its panel, and with 16 vector registers (AVX2: `mr` 4) that traffic, not the FMAs, bounds
        it; x86 FMAs take the vector operand from memory, so the extra sums fit. On a Zen 3 core the 256x1024x1024
        matmul ran at 37% of peak with 4x16 tiles and 74% with 8x16; AVX-512's 8x32 is unchanged. A static row
        count `mr` does not divide takes up to `PANEL_TILE_ROWS` rows for the same reason, so an odd batch of 7 is one
        tile rather than 4 rows and a predicated 3 (the 7x77x1000 layer: 34% -> 57% of peak on Zen 3). Over a
        packed operand the rows are `packed_rows` (or a divisor of at least 4), its panels in L2 needing no more: the
        256x784x512 layer ran 4.8 ms in place (8 x 16) and 2.9 packed (4 x 16) on a Zen 3 core, in one run.

        Every k step loads one broadcast per row and one vector per line and vector tile, for rows x lines x
        vectors FMAs, so of the shapes that fit `accumulators` registers the one with the fewest loads per FMA
        wins (with AVX-512's 16): 4 channels x 2 lines of a 32-wide conv map, 4 x 4 on 16- and 8-wide maps. On the
        benchmark CNN's 8-wide conv that ran at 214-220 GFLOP/s, against 178 with 8 channels x 2 lines. A row
        tile that leaves a tail loses to one that divides the rows (up to as many rows as `accumulators` holds): a
        blocked conv on a 7-wide map tiled 2 + 2 + 2 + 1 columns kept the guarded column's sums in memory, and
        ran 1.7-2x slower than with all 7 columns in one tile (the 3x3 512x7² conv 9.5 -> 5.1 ms on a Zen 3 core).

        Other line contractions (NCHW convs, symbolic extents) put two rules before loads per FMA: a tile of
        `latency_sums` sums (`CPUModel.latency_sums`) first, then one whose vector slab stays in L1
        (`_resident_lines`); the lines may outgrow that slab only as far as the latency needs.
        """
        def rows_of(mr: int) -> int:
            return 1 if roles.row is None else split_factor(loop_extent(sch, roles.row), mr, 4)

        if roles.line is None or width is None:
            packed = self._packed_tile_rows(roles)
            base = packed or self.mr
            rows = rows_of(max(base, PANEL_TILE_ROWS) if panelled and packed is None else base)
            count = _row_count(sch, roles)
            if count is not None and count % rows:  # (a symbolic count is padded to `mr` rows already)
                rows = max(rows, rows_of(max(base, PANEL_TILE_ROWS)))  # 7 rows whole, not 4 + a guarded 3
            return rows, 1, 1
        vectors = -(-width // self.lanes)
        if roles.height is not None or roles.weight_vectors:
            window = self._window_tile(sch, roles, vectors)
            if window is not None:
                return window
        resident = self._resident_lines(sch, roles, width)
        candidates = {rows_of(self.mr), rows_of(max(1, self.mr // 2)), rows_of(max(1, self.accumulators // vectors))}
        extent = _row_count(sch, roles)
        whole = {rows for rows in candidates if extent is None or extent % rows == 0}
        shapes = []
        for rows in whole or candidates:
            latency_lines = -(-self.latency_sums // (rows * vectors))  # lines whose sums hide the FMA latency
            room = min(max(1, self.accumulators // (rows * vectors)), max(resident, latency_lines))
            lines = split_factor(loop_extent(sch, roles.line), room)
            sums = rows * lines * vectors
            shapes.append((sums < self.latency_sums, lines > resident, (rows + lines * vectors) / sums, rows, lines))
        *_, rows, lines = min(shapes)
        return rows, lines, 1

    def _window_tile(self, sch: s_tir.Schedule, roles: _Contraction, vectors: int) -> tuple[int, int, int] | None:
        """(rows, lines, heights) of a blocked conv's register tile: output columns (pixels) x output-channel
        vectors x output rows (a stride-1 window conv's; 1 elsewhere), each a divisor of its extent (a tail's sums
        leave the registers), whose `accumulators` sums keep the FMA units busiest, by the fewest cycles per FMA of
        one reduction step; ties go to fewer weight loads per FMA, then to fewer broadcasts. Before all that, a tile
        leaving every core a task (a dynamic batch counted once). Rows that are a dynamic batch alone (a
        squeeze-excite conv on a 1x1 map) take 1-row tiles: more rows compute padding at batch 1, and a symbolic tail
        guards every row of the tile (the 960 -> 240 conv at batch 1 took 82 us in 16 guarded rows, 18 in 1 row x 5
        lines; at batch 64 316 and 235; 960 -> 1280 at 64 1.71 and 1.29 ms; 2 threads, Emerald Rapids). None when
        another extent is symbolic.

        A step (one input channel and window position) issues rows x heights x lines FMAs, rows x heights broadcasts
        of the input and lines weight vectors, and lasts at least `cpu.FMA_LATENCY` cycles (each sum is one dependent
        chain), its FMAs over `cpu.FMA_UNITS`, its loads over `L1_LOADS_PER_CYCLE`, and its weight vectors over
        `L2_VECTORS_PER_CYCLE`: the weight slab of a tile (lines x all input channels x the window) outgrows L1 and
        streams from L2, while the input is shared by every line. On a Zen 3 core (one thread) the 64x56² and 128x28²
        convs ran at 67-74 GFLOP/s with 2 columns x 4 lines and 77-82 with 4 x 2; 256x14² (no 4 divides 14) at
        57-66 with 2 x 4 and 78-84 with 2 columns x 2 rows x 2 lines; 1 x 8 lines ran at 29-43 everywhere. The
        model picks the 1x1 convs' tiles measured best as well: on AVX-512 7 pixels x 2 lines on a 7² map (512x7²
        201 -> 150 us against 7 x 1, one Emerald Rapids core) and on 14² and 28² maps (0.70-0.83x the time of 14 or
        16 x 1, whose broadcasts bound it); on AVX2 4 x 2 (the 256x14² conv 82 GFLOP/s against 56 in 2 x 4, Zen 3).

        A tile within one output row computes `roles.map_rows` of its products, the kernel rows that read padding
        skipped (`padding_taps.py`), and its cycles count that share: at 28² that breaks the tie between 2 rows x 4
        columns and 1 x 7 for the single row (the 3x3 128x28² conv at batch 8: 8.6 -> 8.1 ms, Zen 4).

        Every tile sums all input channels in registers. Summing a row of tiles one chunk of 4 input channels at a
        time, so that the chunk's weights stayed in L1, stored and reloaded a tile's sums per chunk (16 stores per
        576 FMAs, 6% of a 3x3 kernel's samples on Zen 4): without chunks ResNet's 3x3 convs ran 1-3% faster alone at
        batch 1 and 3-10% at batch 8 on Zen 4, and AVX2 builds of them on that CPU level at batch 8 (Session 26).
        """
        extents = [static_extent(loop_extent(sch, loop)) if loop is not None else 1
                   for loop in (roles.row, roles.line, roles.height)]
        if None in extents[1:]:
            return None
        limit = self.accumulators

        def divisors(n: int) -> list[int]:
            return [d for d in range(1, min(n, limit) + 1) if n % d == 0]

        images = math.prod(static_extent(loop_extent(sch, loop)) or 1 for loop in roles.spatial
                           if loop is not roles.line and loop is not roles.height)
        if extents[0] is None:  # the rows are a dynamic batch alone (a 1x1 map), sized as one image
            extents[0], row_choices = 1, [1]
        else:
            row_choices = divisors(extents[0])
        shapes = []
        for rows in row_choices:
            for lines in divisors(extents[1]):
                for heights in divisors(extents[2]):
                    sums = rows * heights * lines * vectors
                    if sums > limit:
                        continue
                    spots, weights = rows * heights, lines * vectors
                    cycles = max(FMA_LATENCY, sums / FMA_UNITS, (spots + weights) / L1_LOADS_PER_CYCLE,
                                 weights / L2_VECTORS_PER_CYCLE)
                    tasks = images * math.prod(e // t for e, t in zip(extents, (rows, lines, heights), strict=True))
                    share = roles.map_rows if heights == 1 else 1.0  # kernel rows on padding skipped
                    shapes.append((tasks < self.cores, cycles / sums * share, weights / sums, spots / sums, heights,
                                   rows, lines))
        *_, heights, rows, lines = min(shapes)
        return rows, lines, heights

    def _resident_lines(self, sch: s_tir.Schedule, roles: _Contraction, width: int) -> int:
        """The most lines of a register tile over a 1x1 conv that `_window_tile` leaves (its one reduction is over the
        input channels, a matmul over pixels) whose slab of the vector operand, `lines x width` float32
        columns as deep as the channels, fits half of L1: every row tile re-reads it, and from L2 those loads bound
        the FMAs. The 1x1 256x14² conv (256 deep) ran
        at 56 GFLOP/s in 2 pixels x 4 lines (a 32 KiB slab, a Zen 3 core's whole L1) and 82 in 4 x 2. Convs with
        window reductions, whose slab outgrows L1 at any line count, are not limited."""
        depth = static_extent(loop_extent(sch, roles.reduction[0])) if len(roles.reduction) == 1 else None
        if depth is None:
            return self.accumulators
        return max(1, self.l1_bytes // 2 // (depth * width * 4))

    def _column_panels(self, sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, roles: _Contraction,
                       vec_o: s_tir.schedule.LoopRV, vec_i: s_tir.schedule.LoopRV
                       ) -> tuple[list[s_tir.schedule.LoopRV], s_tir.schedule.LoopRV]:
        """Group the column tiles into panels whose slab of the vector operand (all of K for those columns) fits
        `panel_bytes` of L2, so that every row tile reuses a cached slab: ([panel loop], tile loop), or
        ([], vec_o) when the operand fits, an extent of it is symbolic, or the rows (batch dims included, a symbolic
        one counted once) make fewer than two register tiles of `mr`, so that no row tile would reuse a panel. The
        panel loop goes outermost, outside the batch dims too, so the rows of every batch reuse it.

        Without panels each row tile streams the whole operand from beyond L2: with a 256x1024 float32 weight
        (1 MiB) the transformer's FFN matmul ran at 170-176 GFLOP/s on Zen 4, with 128 KiB panels at 206. Few rows
        do not change that: on an Emerald Rapids core (2 MiB L2, AVX-512, packed weights) the encoder's 128-row
        matmuls ran streamed / in panels at 43 / 79% of peak (128x512x2048), 25 / 75% (128x768x3072), 55 / 80%
        (128x768x768) and 74 / 82% (128x512x512, a 1 MiB weight inside L2); AVX2 code of the same shapes and
        64x784x512 on that core was level or up to 7% faster in panels. (Zen 3 figures before packed weights had
        128x768x768 15% and the 64-row MLP layers 4% faster streamed; they were not measured again.)
        """
        if roles.row is None:
            return [], vec_o
        # a symbolic batch dim (a dynamic batch over 128 tokens) counts as one row: the static ones may be enough
        rows = [static_extent(loop_extent(sch, loop)) or 1 for loop in [*roles.spatial, roles.row]]
        extents = [static_extent(loop_extent(sch, loop)) for loop in [*roles.reduction, vec_o, vec_i]]
        if None in extents:
            return [], vec_o
        *depths, tiles, tile = extents
        tile_bytes = math.prod(depths) * tile * sch.get(main).writes[0].source.dtype.bits // 8
        operand = tile_bytes * tiles
        if operand <= self.panel_bytes or math.prod(rows) < 2 * self.mr:
            return [], vec_o
        groups = -(-tiles // max(1, self.panel_bytes // tile_bytes))
        panel, vec_o = sch.split(vec_o, [None, -(-tiles // groups)])  # as even as the tiles allow
        return [panel], vec_o
