"""Gradient clipping, emitted as IR ahead of the update rule: by global norm or by value (torch's
`clip_grad_norm_` and `clip_grad_value_`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kiln.ir import FunctionBuilder, Value
from kiln.ir.gradients import emit


@dataclass(frozen=True)
class GradientClipping:
    """Clip all gradients together to a global L2 norm (`norm`), or each element to [-v, v] (`value`)."""

    kind: Literal["norm", "value"]
    threshold: float

    @staticmethod
    def norm(max_norm: float) -> GradientClipping:
        return GradientClipping("norm", max_norm)

    @staticmethod
    def value(limit: float) -> GradientClipping:
        return GradientClipping("value", limit)

    def emit(self, fb: FunctionBuilder, grads: Sequence[Value]) -> list[Value]:
        """The clipped gradients."""
        if not grads:
            return []
        if self.kind == "value":
            return [emit(fb, "minimum", emit(fb, "maximum", g, fb.constant(-self.threshold, g.type.dtype)),
                         fb.constant(self.threshold, g.type.dtype)) for g in grads]
        dtype = grads[0].type.dtype
        squares = [emit(fb, "sum", emit(fb, "mul", g, g)) for g in grads]
        squares = [s if s.type.dtype is dtype else emit(fb, "cast", s, dtype=dtype) for s in squares]
        total = squares[0]
        for s in squares[1:]:
            total = emit(fb, "add", total, s)
        norm = emit(fb, "sqrt", total)
        coef = emit(fb, "div", fb.constant(self.threshold, dtype), emit(fb, "add", norm, fb.constant(1e-6, dtype)))
        coef = emit(fb, "minimum", coef, fb.constant(1.0, dtype))
        return [emit(fb, "mul", g, coef if g.type.dtype is dtype else emit(fb, "cast", coef, dtype=g.type.dtype))
                for g in grads]
