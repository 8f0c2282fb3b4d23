"""The contract between the Relax lowering driver and the per-op rules registered under `OpDef.rules["relax"]`.

A rule receives an `OpCall` (the block builder, the op's lowered operands with their kiln types, compile-time
values where known, and the attributes) and returns one Relax expression per result; the driver emits them and
casts each to its declared dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm import relax, tirx
from tvm.target import Target

from kiln.ir import KilnError, TensorType, registry

from .dtypes import tvm_dtype

RelaxResult = relax.Expr | tuple[relax.Expr, ...]
RelaxRule = Callable[["OpCall"], RelaxResult]


class NeedsSeed(Exception):
    """Raised when a rule asks for the run seed of a function lowered without one; the driver adds it."""


@dataclass
class OpCall:
    """One op being lowered: everything a rule may use."""

    kind: str
    bb: relax.BlockBuilder
    args: Sequence[relax.Expr]
    types: Sequence[TensorType]
    known: Sequence[np.ndarray | None]
    attrs: Mapping[str, Any]
    run_seed: relax.Expr | None = None
    producers: Sequence[OpCall | None] = ()  # the call that made each operand, where the lowering made it
    precision: str = "f32"  # the build's precision mode after fallback (`lowp.resolve_precision`)
    target: Target | None = None  # the target the build is for (a rule choosing CPU instructions reads it)

    def producer(self, i: int, kind: str) -> OpCall | None:
        """The `kind` call that made operand i (so a rule can fuse it into its own kernel), else None."""
        made = self.producers[i] if i < len(self.producers) else None
        return made if made is not None and made.kind == kind else None

    def emit(self, expr: relax.Expr) -> relax.Expr:
        return self.bb.emit(expr)

    def shape(self, i: int) -> list[tirx.PrimExpr]:
        """The (possibly symbolic) shape of operand i."""
        return shape_of(self.args[i])

    def dtype(self, i: int = 0) -> str:
        """The TVM dtype of operand i."""
        return tvm_dtype(self.types[i].dtype)

    def flag(self, i: int) -> bool | None:
        """The compile-time value of a bool operand (module flags lower as constants of their effective value), or
        None when it is only known at run time (a function input, as eager tensors pass their flags)."""
        value = self.known[i]
        return None if value is None else bool(value)

    def seed(self) -> relax.Expr:
        """The function's run-seed input (an int64 scalar tensor)."""
        if self.run_seed is None:
            raise NeedsSeed
        return self.run_seed


def shape_of(expr: relax.Expr) -> list[tirx.PrimExpr]:
    """The shape values of a tensor expression whose shape Relax knows."""
    shape = expr.ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        raise KilnError(f"Relax could not infer the shape of {expr}")
    return list(shape.values)


def relax_rule(*kinds: str) -> Callable[[RelaxRule], RelaxRule]:
    """Register the decorated function as the Relax lowering of each op kind."""
    def register(fn: RelaxRule) -> RelaxRule:
        for kind in kinds:
            registry.lookup(kind).rules["relax"] = fn
        return fn
    return register
