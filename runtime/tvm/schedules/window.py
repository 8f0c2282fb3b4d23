"""CPU schedule for window reductions (max/avg pooling): vectors across neighbouring outputs, windows unrolled.

Each output of a pool reduces a few inputs (2x2, 3x3), so there is nothing to vectorize inside one window; the
reduction fallback ran them as scalar loops. Here the window loops move outside the innermost output loop, which
is vectorized: every window position is one vector max (or add) over a register of neighbouring outputs.
"""

import math
import re

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..cpu import cpu_model
from .injective import (
    cpu_blocks,
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
        lanes = self.lanes or cpu_model(target).lanes()
        for info in dl.try_inline(sch, infos):
            if not sch.get(info.block_rv).same_as(sch.get(main)):
                schedule_elementwise(sch, info.block_rv, lanes)
        kinds = reductions[0].dom_kind()
        loops = sch.get_loops(main)
        *outer, inner = loops[:kinds.index("R")]
        window = loops[kinds.index("R"):]
        inner_o, inner_i = sch.split(inner, [None, split_factor(loop_extent(sch, inner), lanes, 4)])
        sch.reorder(*outer, inner_o, *window, inner_i)
        sch.parallel(sch.fuse(*outer, inner_o))
        for loop in window:
            sch.unroll(loop)
        sch.vectorize(inner_i)
        init = sch.decompose_reduction(main, window[0])
        sch.vectorize(sch.get_loops(init)[-1])
        return sch

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
