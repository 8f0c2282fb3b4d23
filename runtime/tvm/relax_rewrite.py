"""What kiln's Relax-level rewrites (layouts, constant folding) share: the static shapes they match on, and running
a mutator over every Relax function of a module."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator


def static_shape(ty: object) -> list[int] | None:
    """The shape of a tensor type whose dims are all known, else None."""
    dims = getattr(getattr(ty, "shape", None), "values", None)
    if dims is None or not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return [int(d) for d in dims]


def static_f32_shape(ty: object) -> list[int] | None:
    """The shape of a float32 tensor type whose dims are all known, else None."""
    return static_shape(ty) if getattr(ty, "dtype", None) == "float32" else None


def rewrite_functions(mod: tvm.IRModule, rewriter: PyExprMutator) -> tvm.IRModule:
    """`mod` with every Relax function replaced by `rewriter`'s visit of it (the rewriter was made over `mod`)."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return rewriter.builder_.get()
