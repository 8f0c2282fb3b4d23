"""kiln's CPU schedule rules for TVM's dlight `ApplyDefaultSchedule`, in the order they are tried."""

from tvm.s_tir import dlight as dl

from .injective import CPUInjective
from .matmul import CPUMatmul
from .reduction import CPUReductionFallback
from .row_reduction import CPURowReduction
from .safe import Safe
from .window import CPUWindowReduction

__all__ = [
    "CPUInjective",
    "CPUMatmul",
    "CPUReductionFallback",
    "CPURowReduction",
    "CPUWindowReduction",
    "Safe",
    "default_cpu_rules",
]


def default_cpu_rules() -> list[dl.ScheduleRule]:
    """Matmul/conv first, pooling windows, row reductions (kiln's, then dlight's stock rule), injective, then the
    reduction fallback."""
    return [
        Safe(CPUMatmul()),
        Safe(CPUWindowReduction()),
        Safe(CPURowReduction()),
        Safe(dl.cpu.Reduction()),
        Safe(CPUInjective()),
        Safe(CPUReductionFallback()),
    ]
