"""CPU schedule rule for injective PrimFuncs (elementwise, broadcast, reshape, transpose)."""

from tvm import ir, s_tir, sym, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..cpu import cpu_model

_MIN_PARALLEL_ELEMS = 4096  # below this, waking the thread pool costs more than it saves
PARALLEL_TASKS = 64  # a parallel loop's tasks: the busiest thread takes at most one (1/64 of the work) past its share
TRANSPOSE_LINES = 8  # cache lines of a transposed source row one tile reads (`schedule_transpose`)


def cpu_blocks(func: tirx.PrimFunc, target: Target) -> tuple[s_tir.Schedule | None, list[dl.SBlockInfo] | None]:
    """A schedule of `func` and dlight's normalized view of its blocks, where every kiln rule starts; the blocks
    are None unless `func` is a PrimFunc for an LLVM target that dlight can normalize, and none of them is a
    reduction whose every reduction loop has length 1 (`_unit_reduction`)."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
        return None, None
    sch = s_tir.Schedule(func)
    infos = dl.normalize_prim_func(sch)
    if infos is not None and any(_unit_reduction(sch, info) for info in infos):
        return sch, None
    return sch, infos


def _unit_reduction(sch: s_tir.Schedule, info: dl.SBlockInfo) -> bool:
    """Whether dlight's normalization dropped every (length-1) reduction loop of the block but kept its init: the
    block then looks spatial, and reverse-inlining an epilogue into it applies the epilogue to the init and again
    to the update (a 1-channel 1x1 conv's relu(x * w + b) gave relu(x * w + 2b); softmax over a length-1 axis gave
    values other than 1). No kiln rule takes such a kernel: TVM's unscheduled loops compute it correctly (a matmul
    with K = 1 never gets here: `ops._product` makes it a broadcast product)."""
    return sch.get(info.block_rv).init is not None and "R" not in info.dom_kind()


def static_extent(extent: tirx.Expr) -> int | None:
    """The extent as a Python int, or None when it is symbolic."""
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of `n` that is at most `limit` (a tile that leaves no tail)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def split_factor(extent: tirx.Expr, preferred: int, minimum: int = 1) -> int:
    """Tile size for a loop: the whole loop if short, else the best divisor in [minimum, preferred].

    Divisors that are multiples of 8 (whole AVX registers) win over larger ones. Without a divisor in
    range (or for a symbolic extent) `preferred` is returned and the split leaves a predicated tail,
    which is correct but slower.
    """
    n = static_extent(extent)
    if n is None:
        return preferred
    if n <= preferred:
        return n
    divisors = [d for d in range(minimum, preferred + 1) if n % d == 0]
    return max(divisors, key=lambda d: (d % 8 == 0, d)) if divisors else preferred


def loop_extent(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV) -> tirx.Expr:
    """The extent of a loop of the schedule."""
    return sch.get(loop).extent


def uses_var(expr: tirx.Expr, var: tirx.Var) -> bool:
    """Whether `var` occurs in `expr`."""
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def stride(expr: tirx.Expr, var: tirx.Var) -> int | None:
    """s where `expr` is `s * var + c` with a constant s and c independent of `var`, else None."""
    coeffs = sym.detect_linear_equation(expr, [var])
    return int(coeffs[0].value) if len(coeffs) == 2 and isinstance(coeffs[0], tirx.IntImm) else None


def unit_stride(expr: tirx.Expr, var: tirx.Var) -> bool:
    """Whether `expr` is `var + c` with c independent of `var`."""
    return stride(expr, var) == 1


def worth_parallel(sch: s_tir.Schedule, loops: list[s_tir.schedule.LoopRV]) -> bool:
    """Whether the loop nest does enough work for the thread pool (symbolic extents count as big)."""
    total = 1
    for loop in loops:
        n = static_extent(loop_extent(sch, loop))
        if n is None:
            return True
        total *= n
    return total >= _MIN_PARALLEL_ELEMS


def stores_guarded(stmt: s_tir.SBlock) -> bool:
    """Whether the block stores a guarded load, `if_then_else(inside, x[..], other)` (a conv's zero padding, a
    padded row's copy): TVM's vectorizer makes each lane of it a scalar branch."""
    value = stmt.body.value if isinstance(stmt.body, tirx.BufferStore) else None
    return isinstance(value, ir.Call) and getattr(value.op, "name", "") == "prim.if_then_else"


def vectorize_inner(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, peel_tail: bool = False
                    ) -> list[s_tir.schedule.LoopRV]:
    """Vectorize the block's innermost loop (split to a divisor near `lanes`); returns the loops outside it. With
    `peel_tail`, a static extent no such divisor takes (a row of 197), or a guarded store (`stores_guarded`), has its
    guarded vectors peeled off by TVM's loop partitioning, so the whole vectors inside run unguarded (the caller
    must not fuse the loop outside them)."""
    *outer, inner = sch.get_loops(block)
    extent = static_extent(loop_extent(sch, inner))
    factor = split_factor(loop_extent(sch, inner), lanes, minimum=4)
    if extent != factor:
        inner_o, inner = sch.split(inner, [None, factor])
        outer.append(inner_o)
        if peel_tail and extent is not None and (extent % factor or stores_guarded(sch.get(block))):
            sch.annotate(inner_o, "pragma_loop_partition_hint", 1)
    sch.vectorize(inner)
    return outer


def parallel_tasks(sch: s_tir.Schedule, loops: list[s_tir.schedule.LoopRV]) -> None:
    """Run the spatial `loops` (in any order) as one parallel loop over as few of them, outermost first, as make
    `PARALLEL_TASKS` tasks, the rest serial inside each task: a task recovers its loops' indices by dividing its
    number by the extents inside it, so the fewer loops it fuses, the fewer divisions per vector. Fused down to
    single vectors, an attention head split (8 x 12 x 197 x 4 vectors) ran 1.9-2.1x slower than over its 96
    (batch, head) tasks, the smaller splits 1.1-2x (Zen 4). Symbolic extents go outermost and count as 1 task: fused
    inside, each division is a 64-bit one by a runtime value in every vector (a dynamic batch's attention heads,
    [3, batch, 12, 128, 64], copied at 12 GB/s where the static build ran 50). The rules whose parallel loops are
    any spatial loops all fuse them here."""
    symbolic = [lp for lp in loops if static_extent(loop_extent(sch, lp)) is None]
    ordered = symbolic + [lp for lp in loops if static_extent(loop_extent(sch, lp)) is not None]
    if ordered != loops:
        sch.reorder(*ordered)
    outer, tasks = [], 1
    for loop in ordered:
        outer.append(loop)
        tasks *= static_extent(loop_extent(sch, loop)) or 1
        if tasks >= PARALLEL_TASKS:
            break
    sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


def schedule_elementwise(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """Parallelize the outer loops of a spatial block and vectorize its innermost loop in steps of `lanes`."""
    loops = sch.get_loops(block)
    if not loops:
        return
    parallel = worth_parallel(sch, loops)
    outer = vectorize_inner(sch, block, lanes)
    if outer and parallel:
        parallel_tasks(sch, outer)


def _transposed_axis(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> int | None:
    """Position of the loop that indexes the last dimension of a transposed read, if any.

    A read is transposed when its last index walks an outer loop with stride 1 (`v` or `h * 64 + v` after a
    reshape, or `c % 16`, a blocked layout's lane, leaving NCHW[16]c) while the innermost loop indexes one of its
    other dimensions: vectorizing the innermost loop alone would then stride through memory. A blocked lane counts
    only where the innermost loop fills a vector of `lanes` (rows of 14 or 7 pixels ran 2-3x slower tiled).
    """
    stmt = sch.get(block)
    iter_vars = [iv.var for iv in stmt.iter_vars]
    if len(iter_vars) < 2:
        return None
    innermost = iter_vars[-1]
    for read in stmt.reads:
        if not read.region:  # a scalar
            continue
        *lead, last = (r.min for r in read.region)
        if isinstance(last, tirx.FloorMod):  # consecutive `c` read consecutive lanes within a block
            inner = static_extent(loop_extent(sch, sch.get_loops(block)[-1]))
            if inner is None or inner < lanes:
                continue
            last = last.a
        outer = [i for i, v in enumerate(iter_vars[:-1]) if unit_stride(last, v)]
        if outer and any(uses_var(e, innermost) for e in lead):
            return outer[0]
    return None


def schedule_transpose(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, axis: int, rows: int, lanes: int
                       ) -> None:
    """Tile the transposed loop pair `rows` (the source's contiguous axis) x `lanes` (one vector of the output):
    each vector gathers from only `lanes` source rows, whose lines stay in L1 while `rows` outputs rows reuse them,
    and every output line is filled before it leaves.

    The 16 x 16 tile gathered from 16 rows at once: rows 12 KiB or 4 KiB apart share one L1 set, more lines than its
    8 ways, so 768x3072 and 1024x1024 ran at 3.6-4.3 GB/s against 13.7 for 768x768; 128 x 8 took 768x3072 6.0 ->
    3.8 ms, 1024x1024 2.7 -> 1.8, 256x1024 0.35 -> 0.13 (one Zen 3 core, CPU time, best of 7, load 6).
    """
    loops = sch.get_loops(block)
    parallel = worth_parallel(sch, loops)
    row, col = loops[axis], loops[-1]
    others = [lp for i, lp in enumerate(loops[:-1]) if i != axis]
    row_o, row_i = sch.split(row, [None, split_factor(loop_extent(sch, row), rows, minimum=4)])
    col_o, col_i = sch.split(col, [None, split_factor(loop_extent(sch, col), lanes, minimum=4)])
    sch.reorder(*others, row_o, col_o, row_i, col_i)
    if parallel:
        parallel_tasks(sch, [*others, row_o, col_o])
    sch.vectorize(col_i)


def vectorize_inner_all(sch: s_tir.Schedule, infos: list[dl.SBlockInfo], lanes: int, parallel: bool) -> None:
    """Split the one loop every block of `infos` shares into vectors of `lanes`, the outer part parallel."""
    (loop,) = sch.get_loops(infos[0].block_rv)
    outer, inner = sch.split(loop, [None, split_factor(loop_extent(sch, loop), lanes, minimum=4)])
    sch.vectorize(inner)
    if parallel:
        sch.parallel(outer)


def _nest_outputs(sch: s_tir.Schedule, infos: list[dl.SBlockInfo], lanes: int) -> bool:
    """Several elementwise outputs over one domain (a grouped function with several results, such as Adam's new
    weight and moments): compute each earlier one a vector at a time inside the last one's loop, so every value is
    read and written in one pass. False (nothing done) unless the blocks share their loop extents."""
    if len(infos) < 2:
        return False
    extents = [[static_extent(loop_extent(sch, lp)) for lp in sch.get_loops(i.block_rv)] for i in infos]
    if None in extents[0] or any(e != extents[0] for e in extents) or _transposed_axis(sch, infos[-1].block_rv, lanes):
        return False
    loops = [sch.fuse(*sch.get_loops(i.block_rv)) for i in infos]
    parallel = worth_parallel(sch, loops[-1:])
    sch.merge(*loops)
    vectorize_inner_all(sch, infos, lanes, parallel)
    return True


class CPUInjective(dl.ScheduleRule):
    """Inline chains of spatial blocks, then parallelize and vectorize (or tile, when transposing) what remains;
    vectors are the target CPU's (`kiln.runtime.tvm.cpu`), transpose tiles `TRANSPOSE_LINES` cache lines of float32
    by one vector."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        sch, infos = cpu_blocks(func, target)
        if infos is None or not all(info.is_injective() for info in infos):
            return None
        model = cpu_model(target)
        rest = dl.try_inline(sch, infos)
        if _nest_outputs(sch, rest, model.lanes()):
            return sch
        for info in rest:
            axis = _transposed_axis(sch, info.block_rv, model.lanes())
            if axis is None:
                schedule_elementwise(sch, info.block_rv, model.lanes())
            else:
                schedule_transpose(sch, info.block_rv, axis, TRANSPOSE_LINES * model.caches.line // 4,
                                   model.lanes())
        return sch
