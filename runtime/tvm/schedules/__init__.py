"""kiln's CPU schedule rules for TVM's dlight `ApplyDefaultSchedule`, in the order they are tried."""

from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..calibration import stored_tile
from ..cpu import cpu_model
from .column_reduction import CPUColumnReduction
from .injective import CPUInjective
from .matmul import CPUMatmul
from .plane_window import CPUPlaneWindow
from .reduction import CPUReductionFallback
from .row_reduction import CPURowReduction
from .safe import Safe
from .window import CPUWindowReduction

__all__ = [
    "CPUColumnReduction",
    "CPUInjective",
    "CPUMatmul",
    "CPUPlaneWindow",
    "CPUReductionFallback",
    "CPURowReduction",
    "CPUWindowReduction",
    "Safe",
    "default_cpu_rules",
]


def default_cpu_rules(target: Target | None = None, tile: dict[str, int] | None = None) -> list[dl.ScheduleRule]:
    """NCHW depthwise convs' and pools' plane kernels (by block name), matmul/conv, pooling windows, column
    reductions (bias gradients, pools over a blocked map's H and W), row reductions (kiln's, then dlight's stock
    rule), injective, then the reduction fallback. Every rule takes its sizes from the CPU model of the target it is
    applied for; the matmul/conv tile is `tile` if given (calibration's candidates), else the stored calibration of
    `target`'s CPU, if any. The column rule goes before the row rule, which would take a column reduction with an
    epilogue (a mean) lane by lane."""
    if tile is None and target is not None and target.kind.name == "llvm":
        tile = stored_tile(cpu_model(target))
    return [
        Safe(CPUPlaneWindow()),
        Safe(CPUMatmul(**(tile or {}))),
        Safe(CPUWindowReduction()),
        Safe(CPUColumnReduction()),
        Safe(CPURowReduction()),
        Safe(dl.cpu.Reduction()),
        Safe(CPUInjective()),
        Safe(CPUReductionFallback()),
    ]
