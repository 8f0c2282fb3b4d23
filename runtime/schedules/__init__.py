"""kiln's CPU schedule rules for TVM's dlight `ApplyDefaultSchedule`, in the order they are tried."""

from tvm.s_tir import dlight as dl

from .injective import CPUInjective
from .matmul import CPUMatmul
from .reduction import CPUReductionFallback
from .safe import Safe

__all__ = ["CPUInjective", "CPUMatmul", "CPUReductionFallback", "Safe", "default_cpu_rules"]


def default_cpu_rules() -> list[dl.ScheduleRule]:
    """Matmul/conv first, stock softmax/norm reductions, injective, then the reduction fallback."""
    return [
        Safe(CPUMatmul()),
        Safe(dl.cpu.Reduction()),
        Safe(CPUInjective()),
        Safe(CPUReductionFallback()),
    ]
