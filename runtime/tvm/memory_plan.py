"""Memory planning over a dynamic batch: Relax's static plan shares storage between tensors only when their sizes
are known, so a build whose batch is symbolic allocated every intermediate on its own (39 storages in
MobileNetV3-Large against 8 static) and its kernels read and wrote cold memory. Bounding the batch (`max_batch`)
lets the plan size shared storages for the largest batch: MobileNetV3-Large at batch 8 ran 1.18x its static build
unplanned and 1.03-1.05x planned (2 threads, Emerald Rapids VM). A call past the bound runs an unbounded build instead.

A batch dim is a symbolic dim that is the leading axis of every input it occurs in; dims elsewhere (a sequence
length) keep no bound, as no bound for them can be guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # TVM loads on first use: `kiln.compile` reads the default below at import
    import tvm
    from tvm import relax

DEFAULT_MAX_BATCH = 64  # planned storage is virtual until touched: a batch of 1 touches 1/64 of it
BOUND_ATTR = "tir_var_upper_bound"  # read by Relax's StaticPlanBlockMemory


def batch_dims(func: relax.Function) -> dict[str, list[tuple[int, int]]]:
    """The symbolic vars of `func` that are a leading (batch) dim wherever its tensor inputs use them, with the
    (input, axis 0) positions they occur at."""
    from tvm import tirx

    seen: dict[str, list[tuple[int, int]]] = {}
    elsewhere: set[str] = set()
    for index, param in enumerate(func.params):
        shape = getattr(param.ty, "shape", None)
        values = getattr(shape, "values", None) or ()
        for axis, dim in enumerate(values):
            for var in tirx.analysis.undefined_vars(dim):
                if axis == 0 and isinstance(dim, tirx.Var):
                    seen.setdefault(var.name, []).append((index, 0))
                else:
                    elsewhere.add(var.name)
    return {name: positions for name, positions in seen.items() if name not in elsewhere}


def bound_batches(bounds: Mapping[str, Mapping[str, int]]) -> tvm.transform.Pass:
    """The module pass giving each Relax function named in `bounds` its batch vars' upper bounds."""
    import tvm
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="KilnBoundBatches")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and bounds.get(gvar.name_hint):
                out[gvar] = func.with_attr(BOUND_ATTR, dict(bounds[gvar.name_hint]))
        return out

    return _pass
