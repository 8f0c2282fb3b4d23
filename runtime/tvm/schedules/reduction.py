"""Last-resort CPU schedule for reductions no other rule matched: parallelize leading spatial loops."""

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from .injective import cpu_blocks, parallel_tasks


class CPUReductionFallback(dl.ScheduleRule):
    """Inline what can be inlined, then run each remaining block's leading spatial loops in parallel."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        sch, infos = cpu_blocks(func, target)
        if infos is None or all(info.is_injective() for info in infos):
            return None
        applied = False
        for info in dl.try_inline(sch, infos):
            kinds = info.dom_kind()
            leading = len(kinds) - len(kinds.lstrip("S"))
            if leading:
                parallel_tasks(sch, sch.get_loops(info.block_rv)[:leading])
                applied = True
        return sch if applied else None
