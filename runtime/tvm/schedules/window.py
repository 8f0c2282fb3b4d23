"""CPU schedule for window reductions (max/avg pooling, blocked depthwise convs): vectors across neighbouring
outputs, windows unrolled, a row of outputs summed in registers.

Each output of a pool reduces a few inputs (2x2, 3x3), so there is nothing to vectorize inside one window; the
reduction fallback ran them as scalar loops. Here the window loops move outside the innermost output loop, which
is vectorized: every window position is one vector max (or add) over a register of neighbouring outputs, for each
of a register tile of outputs along the next loop out, whose independent sums hide the FMA latency.
"""

import math
import re

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..cpu import cpu_model
from .injective import (
    cpu_blocks,
    largest_divisor,
    loop_extent,
    schedule_elementwise,
    split_factor,
    static_extent,
    uses_var,
)

MAX_WINDOW = 64  # larger reductions are rows, not windows: `CPURowReduction` and the fallbacks take them


class CPUWindowReduction(dl.ScheduleRule):
    """One reduction block over a small static window whose input walks with the innermost output index; vectors of
    `lanes` outputs (default: one register of the target CPU)."""

    def __init__(self, lanes: int | None = None) -> None:
        self.lanes = lanes

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        sch, infos = cpu_blocks(func, target)
        if infos is None:
            return None
        reductions = [info for info in infos if not info.is_injective()]
        if len(reductions) != 1 or not self._is_window(sch, reductions[0]):
            return None
        main = reductions[0].block_rv
        model = cpu_model(target)
        lanes = self.lanes or model.lanes()
        epilogues = [info.block_rv for info in dl.try_inline(sch, infos)
                     if not sch.get(info.block_rv).same_as(sch.get(main))]
        kinds = reductions[0].dom_kind()
        loops = sch.get_loops(main)
        *outer, inner = loops[:kinds.index("R")]
        window = loops[kinds.index("R"):]
        inner_o, inner_i = sch.split(inner, [None, split_factor(loop_extent(sch, inner), lanes, 4)])
        rows = self._row_tile(sch, outer[-1], model.accumulators) if outer else 1
        row_i: list[s_tir.schedule.LoopRV] = []
        if rows > 1:
            row_o, row_inner = sch.split(outer[-1], [None, rows])
            outer, row_i = [*outer[:-1], row_o], [row_inner]
        sch.reorder(*outer, inner_o, *window, *row_i, inner_i)
        tasks = sch.fuse(*outer, inner_o)
        sch.parallel(tasks)
        for loop in [*window, *row_i]:
            sch.unroll(loop)
        sch.vectorize(inner_i)
        if rows > 1:  # the tile's sums in registers, stored (with the epilogue) once the window is done
            tile = sch.cache_write(main, 0, "local")
            sch.reverse_compute_at(tile, tasks, preserve_unit_loops=True)
            *_, tile_rows, tile_lanes = sch.get_loops(tile)
            sch.unroll(tile_rows)
            sch.vectorize(tile_lanes)
            epilogues = [b for b in epilogues if not self._inlined(sch, b)]
        for block in epilogues:
            schedule_elementwise(sch, block, lanes)
        init = sch.decompose_reduction(main, window[0])
        sch.vectorize(sch.get_loops(init)[-1])
        return sch

    @staticmethod
    def _row_tile(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, accumulators: int) -> int:
        """Outputs along `loop` (the one outside the vector: a blocked map's columns, an NCHW map's rows) that one
        register tile sums at once, the largest divisor of its extent up to `accumulators`: one output alone is a
        chain of dependent FMAs (or maxima), one FMA latency per window tap, and reloads every tap's weight (a 5x5
        depthwise conv on a blocked 28-wide map ran at a quarter of the FMA units' rate)."""
        extent = static_extent(loop_extent(sch, loop))
        if extent is None:
            return 1
        return largest_divisor(extent, accumulators)

    @staticmethod
    def _inlined(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
        """Reverse-inline an elementwise epilogue into the tile's store; False where it cannot be."""
        try:
            sch.reverse_compute_inline(block)
        except s_tir.ScheduleError:
            return False
        return True

    @staticmethod
    def _is_window(sch: s_tir.Schedule, info: dl.SBlockInfo) -> bool:
        """Spatial loops then a static window of at most MAX_WINDOW elements that slides along the last output
        index: some input's last index combines that output index with a window index (`ow * stride + kw`), or is
        that output index itself while the window slides along the one before (a blocked NCHW[x]c map, whose last
        index is a lane of channels: `x[.., ow * stride + kw, c]`, the vector a contiguous load; a matmul's `B[k, j]`
        slides along no output index)."""
        kinds = info.dom_kind()
        if not re.fullmatch("S+R+", kinds):
            return False
        window = [static_extent(loop_extent(sch, it.loop_rv)) for it in info.iters if it.kind == "R"]
        if None in window or math.prod(window) > MAX_WINDOW:
            return False
        outputs = [it.var for it in info.iters if it.kind == "S"]
        slide = [it.var for it in info.iters if it.kind == "R"]

        def slides(index: tirx.Expr, along: list[tirx.Var]) -> bool:
            return any(uses_var(index, o) for o in along) and any(uses_var(index, r) for r in slide)

        return any(slides(read.region[-1].min, outputs[-1:])
                   or len(read.region) > 1 and read.region[-1].min.same_as(outputs[-1])
                   and slides(read.region[-2].min, outputs[:-1])
                   for read in sch.get(info.block_rv).reads)
