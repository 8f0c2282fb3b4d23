"""CPU schedule for column reductions: a `sum` or `mean` over axes outside the contiguous one (a bias or norm-scale
gradient over the rows of [rows, width]; a global average pool over H and W of a blocked NCHW[16]c map).

The stock `dlight.cpu.Reduction` walks such a sum column by column, one scalar add per element down a column of
stride `width`: a [1024, 256] f32 sum took 2-7 ms on 2 Zen 3 cores (load 8). This rule puts the reduction loops
outside a vector loop over a block of adjacent columns, so each row's slice is one contiguous vector load per
register, and runs the column blocks in parallel: the same sum took ~1 ms under the same load. An elementwise
epilogue (the mean's division) is computed per column block after its sums, and the blocks are narrowed until
every core has one where the input is worth the thread pool: MobileNetV3's squeeze-excite pool over 1x8x28x28x16
took 25 us as scalar lanes under the row rule, 400 KB at 16 GB/s.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..cpu import cpu_model
from .injective import (
    cpu_blocks,
    largest_divisor,
    loop_extent,
    split_factor,
    static_extent,
    uses_var,
    worth_parallel,
)

VECTORS_PER_TASK = 8  # registers of adjacent columns one parallel task accumulates (64 f32 on AVX2: 4 cache lines)


def _walks_columns(stmt: tirx.SBlock, spatial: int) -> bool:
    """Whether the reduction block `stmt` (its first `spatial` iter vars spatial, the rest reduced) reads every
    operand along its last spatial axis with the reduced axes outside the contiguous one: a column reduction."""
    column = stmt.iter_vars[spatial - 1].var
    reduced = [iv.var for iv in stmt.iter_vars[spatial:]]
    return bool(stmt.reads) and all(uses_var(r.region[-1].min, column) and not any(
        uses_var(r.region[-1].min, v) for v in reduced) for r in stmt.reads)


def _task_shape(rows: int, columns: int, lanes: int, cores: int, parallel: bool) -> tuple[int, int]:
    """(rows, columns) of one parallel task over `rows` x `columns` sums (the leading spatial axes fused, and the
    contiguous last one): `VECTORS_PER_TASK` vectors of adjacent columns, or whole rows of a short last axis
    (a blocked map's 16 lanes) stacked to as many; halved, rows first, until every core has a task where the work
    is worth the pool. Both divide their extents where a divisor exists, so a task's sums are a rectangle."""
    widest = VECTORS_PER_TASK * lanes
    width = split_factor(tirx.IntImm("int64", columns), widest, minimum=min(lanes, columns))
    height = largest_divisor(rows, max(1, widest // width))
    while parallel and -(-rows // height) * -(-columns // width) < cores:
        if height > 1:
            height = largest_divisor(rows, height // 2)
        elif width // 2 >= lanes and columns % (width // 2) == 0:
            width //= 2
        else:
            break
    return height, width


class CPUColumnReduction(dl.ScheduleRule):
    """A reduction over trailing loops (kinds S...SR...R) whose reads walk the last spatial axis contiguously,
    optionally followed by elementwise blocks over its result."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        sch, infos = cpu_blocks(func, target)
        if infos is None:
            return None
        infos = dl.try_inline(sch, infos)
        if not infos or not infos[0].is_reduction() or not all(i.is_injective() for i in infos[1:]):
            return None
        kinds = infos[0].dom_kind()
        spatial = len(kinds) - len(kinds.lstrip("S"))
        block = infos[0].block_rv
        loops = sch.get_loops(block)
        if spatial == 0 or kinds[spatial:].strip("R") or len(loops) != len(kinds):
            return None
        if not _walks_columns(sch.get(block), spatial):
            return None  # the reduced axes are the contiguous ones: a row reduction
        model = cpu_model(target)
        *leading, last = loops[:spatial]
        columns = static_extent(loop_extent(sch, last))
        if columns is None:
            return None
        # a symbolic batch: tasks are sized within one image's rows, which every batch's multiple of them divides
        rows_n = math.prod(n for lp in leading if (n := static_extent(loop_extent(sch, lp))) is not None)
        rows = sch.fuse(*leading) if len(leading) > 1 else next(iter(leading), None)
        parallel = worth_parallel(sch, sch.get_loops(block))
        height, width = _task_shape(rows_n, columns, model.lanes(), model.cores, parallel)
        columns_o, columns_i = sch.split(last, [None, width])
        if rows is None:
            tasks, inner = columns_o, [columns_i]
        else:
            rows_o, rows_i = sch.split(rows, [None, height])
            sch.reorder(rows_o, columns_o, rows_i, columns_i)
            tasks, inner = sch.fuse(rows_o, columns_o), [rows_i, columns_i]
        sch.reorder(tasks, *loops[spatial:], *inner)
        for epilogue in infos[1:]:
            sch.reverse_compute_at(epilogue.block_rv, tasks)
        if parallel:
            sch.parallel(tasks)
        sch.vectorize(columns_i)  # first: TVM refuses to vectorize over a block whose init was split off
        init = sch.decompose_reduction(block, loops[spatial])
        for vectorized in (init, *(epilogue.block_rv for epilogue in infos[1:])):
            sch.vectorize(sch.get_loops(vectorized)[-1])
        return sch
